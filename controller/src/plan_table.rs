//! `archipelago plan --compare`: several layouts of one job side by side — actors, the largest
//! memory estimate of any device, the predicted step and bubble, and the bytes every actor reads
//! from its peers per step — or why a layout was refused.

use archipelago_dataflow::Plan;
use archipelago_dataflow::memory::mib;

/// One layout's column values.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// The flags that make the layout.
    pub flags: String,
    /// What the plan predicts, or why it was refused.
    pub outcome: Result<Figures, String>,
}

/// What a compiled layout predicts.
#[derive(Debug, Clone, PartialEq)]
pub struct Figures {
    /// The mesh, printed (`dp=2 × pp=2`).
    pub mesh: String,
    /// Actors.
    pub actors: usize,
    /// The largest per-device memory estimate, bytes.
    pub peak_device_bytes: u64,
    /// Predicted step, seconds.
    pub step_s: f64,
    /// The largest predicted bubble of any stage.
    pub bubble: f64,
    /// Bytes read from peers per step, summed over actors.
    pub peer_bytes: u64,
}

impl Row {
    /// The row of a compiled layout.
    pub fn of(flags: &str, plan: &Plan) -> Row {
        Row {
            flags: flags.to_string(),
            outcome: Ok(Figures {
                mesh: plan.mesh.to_string(),
                actors: plan.actors.len(),
                peak_device_bytes: plan.memory.iter().map(|m| m.total()).max().unwrap_or(0),
                step_s: plan.prediction.step_s,
                bubble: plan.prediction.bubble.iter().copied().fold(0.0, f64::max),
                peer_bytes: plan.fabric.iter().map(|f| f.total()).sum(),
            }),
        }
    }

    /// The row of a refused layout.
    pub fn refused(flags: &str, why: &str) -> Row {
        Row {
            flags: flags.to_string(),
            outcome: Err(why.to_string()),
        }
    }
}

/// The table: a header, one line per layout, then each refusal in full.
pub fn render(rows: &[Row]) -> String {
    let width = rows
        .iter()
        .map(|r| r.flags.len())
        .max()
        .unwrap_or(0)
        .max("layout".len());
    let mut out = format!(
        "{:<width$}  {:<14} {:>6}  {:>14}  {:>15}  {:>6}  {:>16}\n",
        "layout", "mesh", "actors", "memory/device", "predicted step", "bubble", "peer bytes/step"
    );
    let mut refusals = Vec::new();
    for row in rows {
        match &row.outcome {
            Ok(f) => out.push_str(&format!(
                "{:<width$}  {:<14} {:>6}  {:>14}  {:>12.1} ms  {:>6.3}  {:>16}\n",
                row.flags,
                f.mesh,
                f.actors,
                mib(f.peak_device_bytes),
                1e3 * f.step_s,
                f.bubble,
                mib(f.peer_bytes)
            )),
            Err(why) => {
                out.push_str(&format!("{:<width$}  refused (below)\n", row.flags));
                refusals.push(format!("{}: {why}", row.flags));
            }
        }
    }
    for refusal in refusals {
        out.push_str(&format!("\n{refusal}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_has_a_line_per_layout_and_names_refusals() {
        let ok = Row {
            flags: "--dp 2".into(),
            outcome: Ok(Figures {
                mesh: "dp=2".into(),
                actors: 2,
                peak_device_bytes: 3 << 20,
                step_s: 0.25,
                bubble: 0.0,
                peer_bytes: 1 << 20,
            }),
        };
        let text = render(&[
            ok,
            Row::refused("--dp 3", "--batch 16 is not divisible by --dp 3"),
        ]);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("layout"), "{text}");
        assert!(
            lines[1].contains("250.0 ms") && lines[1].contains("3.0 MiB"),
            "{text}"
        );
        assert!(lines[2].contains("refused"), "{text}");
        assert!(text.contains("--dp 3: --batch 16 is not divisible"), "{text}");
    }
}
