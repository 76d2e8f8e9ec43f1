//! The tables of the bench summary and the formatting of their cells: a title heading the
//! label column, column heads naming their units, a row per measurement; numbers to three
//! significant figures; a figure the JSON lacks shown as [`MISSING`], never left out.

use serde_json::Value;

/// What a cell shows for a figure the JSON lacks.
pub(super) const MISSING: &str = "missing";

/// One table of a section: the title heads the label column, the rows are indented under it.
pub(super) struct Table {
    title: String,
    heads: Vec<String>,
    rows: Vec<(String, Vec<String>)>,
}

impl Table {
    /// A table titled `title` with these column heads.
    pub(super) fn new(title: impl Into<String>, heads: &[&str]) -> Table {
        Table {
            title: title.into(),
            heads: heads.iter().map(|h| h.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row (cells past the heads are dropped, missing ones left blank).
    pub(super) fn row(&mut self, label: impl Into<String>, cells: Vec<String>) {
        self.rows.push((label.into(), cells));
    }

    /// The table as lines: the title and the heads, then a line per row.
    pub(super) fn lines(&self) -> Vec<String> {
        let width = |s: &str| s.chars().count();
        let label_width = (self.rows.iter().map(|(l, _)| 2 + width(l)))
            .chain([width(&self.title)])
            .max()
            .unwrap_or(0);
        let cell = |row: &[String], i: usize| row.get(i).cloned().unwrap_or_default();
        let widths: Vec<usize> = (0..self.heads.len())
            .map(|i| {
                let cells = self.rows.iter().map(|(_, r)| width(&cell(r, i)));
                cells.chain([width(&self.heads[i])]).max().unwrap_or(0)
            })
            .collect();
        let line = |label: String, cells: &[String]| {
            let mut text = format!("{label:<label_width$}");
            for (i, w) in widths.iter().enumerate() {
                text.push_str(&format!("  {:>w$}", cell(cells, i)));
            }
            text.trim_end().to_string()
        };
        let mut lines = vec![line(self.title.clone(), &self.heads)];
        for (label, cells) in &self.rows {
            lines.push(line(format!("  {label}"), cells));
        }
        lines
    }
}

/// The number at `pointer` (a JSON pointer such as `/round_trips/sync_per_s`) in `value`.
pub(super) fn at(value: &Value, pointer: &str) -> Option<f64> {
    value.pointer(pointer).and_then(Value::as_f64)
}

/// `x` to three significant figures, thousands as `k` and millions as `M`.
pub(super) fn num(x: f64) -> String {
    let a = x.abs();
    if !x.is_finite() {
        x.to_string()
    } else if a >= 1e6 {
        format!("{}M", significant(x / 1e6))
    } else if a >= 1e4 {
        format!("{}k", significant(x / 1e3))
    } else {
        significant(x)
    }
}

fn significant(x: f64) -> String {
    if x == 0.0 {
        return "0".into();
    }
    let decimals = (2 - x.abs().log10().floor() as i32).clamp(0, 6) as usize;
    format!("{x:.decimals$}")
}

/// A setting or an aim as it was given (`5`, `1.1`), or [`MISSING`].
pub(super) fn plain(x: Option<f64>) -> String {
    x.map_or_else(|| MISSING.into(), |x| x.to_string())
}

/// The figure, or [`MISSING`].
pub(super) fn fig(x: Option<f64>) -> String {
    x.map_or_else(|| MISSING.into(), num)
}

/// The figure with its unit (`963 samples/s`), or [`MISSING`].
pub(super) fn fig_unit(x: Option<f64>, unit: &str) -> String {
    x.map_or_else(|| MISSING.into(), |x| format!("{} {unit}", num(x)))
}

/// The figure and a ratio beside it (`3.36 (0.90)`); [`MISSING`] for either one absent.
pub(super) fn with_ratio(x: Option<f64>, ratio: Option<f64>) -> String {
    match x {
        Some(x) => format!("{} ({})", num(x), fig(ratio)),
        None => MISSING.into(),
    }
}

/// The one-minute load average of `value["load_avg"]` when the figure was taken.
pub(super) fn load(value: &Value) -> String {
    fig(at(value, "/load_avg/0"))
}

/// The mean of a per-actor list of numbers (`[2.34, 4.27]`).
pub(super) fn mean(value: &Value) -> Option<f64> {
    let xs: Vec<f64> = value.as_array()?.iter().filter_map(Value::as_f64).collect();
    (!xs.is_empty()).then(|| xs.iter().sum::<f64>() / xs.len() as f64)
}

/// The entries of the list `value[key]`, or `None` when it is absent or empty.
pub(super) fn list<'a>(value: &'a Value, key: &str) -> Option<&'a Vec<Value>> {
    value.get(key)?.as_array().filter(|l| !l.is_empty())
}

/// One line saying that a whole section is absent from the JSON.
pub(super) fn missing_section(what: &str) -> Vec<String> {
    vec![format!("{what}: {MISSING} (not in the JSON)")]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_keep_three_significant_figures() {
        assert_eq!(num(1_393_581.8), "1.39M");
        assert_eq!(num(346_001.5), "346k");
        assert_eq!(num(47_554.2), "47.6k");
        assert_eq!(num(3235.0), "3235");
        assert_eq!(num(3.357), "3.36");
        assert_eq!(num(0.006_369), "0.00637");
        assert_eq!(num(0.0), "0");
        assert_eq!(fig(None), MISSING);
        assert_eq!(plain(Some(5.0)), "5");
        assert_eq!(with_ratio(Some(3.357), None), "3.36 (missing)");
    }

    #[test]
    fn a_table_aligns_its_columns_under_the_heads() {
        let mut t = Table::new("title", &["GB/s", "load"]);
        t.row("a long label", vec!["3.36".into(), "4.1".into()]);
        t.row("b", vec![MISSING.into()]);
        let lines = t.lines();
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[0], "title              GB/s  load");
        assert_eq!(lines[1], "  a long label     3.36   4.1");
        assert_eq!(lines[2], "  b             missing");
    }
}
