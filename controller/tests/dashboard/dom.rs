//! Reading the dashboard's DOM as headless Chromium dumps it: the part of the page from an
//! element to the end of it, the tick labels of an axis, the values of the loss chart's points
//! (their titles), the lane names, the legend, a host's row. Each checker says what it found
//! missing, with the part of the DOM it looked at.

/// The text from `start` to the first `end` after it (empty when `start` is not there).
pub fn part<'a>(dom: &'a str, start: &str, end: &str) -> &'a str {
    dom.split_once(start)
        .map(|(_, rest)| rest.split(end).next().unwrap_or(rest))
        .unwrap_or_default()
}

/// The texts of the elements of class `class` in `html`.
pub fn texts_of_class<'a>(html: &'a str, class: &str) -> Vec<&'a str> {
    html.split(&format!("class=\"{class}\""))
        .skip(1)
        .filter_map(|rest| rest.split_once('>').map(|(_, text)| text))
        .map(|text| text.split('<').next().unwrap_or_default())
        .collect()
}

/// The tick labels of the axis with `id`, as numbers; asserts there are at least 3, increasing.
pub fn ticks(dom: &str, id: &str) -> Vec<f64> {
    let axis = part(dom, &format!("id=\"{id}\""), "</g>");
    let labels: Vec<f64> = texts_of_class(axis, "tick-label")
        .iter()
        .map(|t| {
            t.parse()
                .unwrap_or_else(|_| panic!("tick label {t:?} of {id} is no number"))
        })
        .collect();
    assert!(
        labels.len() >= 3,
        "axis {id} has {} tick labels: {axis}",
        labels.len()
    );
    assert!(
        labels.windows(2).all(|w| w[0] < w[1]),
        "the tick labels of {id} do not increase: {labels:?}"
    );
    labels
}

/// A point of the loss chart, as its title (the hover text) gives it.
#[derive(Debug)]
pub struct Point {
    pub step: u64,
    pub loss: f64,
    pub lr: Option<f64>,
}

/// The points of the loss chart, from their titles (`step N  loss X  lr Y …`).
pub fn points(dom: &str) -> Vec<Point> {
    let chart = part(dom, "id=\"loss-points\"", "</g>");
    chart
        .split("<title>")
        .skip(1)
        .map(|t| {
            let words: Vec<&str> = t
                .split('<')
                .next()
                .unwrap_or_default()
                .split_whitespace()
                .collect();
            let after = |key: &str| words.iter().position(|w| *w == key).map(|i| words[i + 1]);
            Point {
                step: after("step")
                    .and_then(|s| s.parse().ok())
                    .expect("a step in the title"),
                loss: after("loss")
                    .and_then(|s| s.parse().ok())
                    .expect("a loss in the title"),
                lr: after("lr").and_then(|s| s.parse().ok()),
            }
        })
        .collect()
}

/// The names of the timeline's lanes.
pub fn lane_names(dom: &str) -> Vec<&str> {
    texts_of_class(part(dom, "id=\"timeline\"", "</svg>"), "lane-label")
}

/// The categories the timeline's legend lists; asserts each is drawn with its colour on the
/// timeline and the legend says what a gap is.
pub fn legend(dom: &str) -> Vec<String> {
    let legend = part(dom, "id=\"timeline-legend\"", "</div>");
    let cats: Vec<String> = legend
        .split("data-cat=\"")
        .skip(1)
        .filter_map(|rest| rest.split('"').next())
        .map(str::to_string)
        .collect();
    let timeline = part(dom, "id=\"timeline\"", "</svg>");
    for cat in &cats {
        assert!(
            timeline.contains(&format!("class=\"span cat-{cat}\"")),
            "the legend lists {cat}, which the timeline does not draw"
        );
        assert!(
            legend.contains(&format!("class=\"swatch cat-{cat}\"")),
            "no swatch for {cat}: {legend}"
        );
    }
    assert!(
        legend.contains("gap: idle"),
        "the legend does not say what a gap is: {legend}"
    );
    cats
}

/// The row of host `name` in the cluster table.
pub fn host_row<'a>(dom: &'a str, name: &str) -> &'a str {
    let table = part(dom, "id=\"cluster\"", "</table>");
    let row = table
        .split("<tr ")
        .find(|row| row.contains(&format!("data-host=\"{name}\"")))
        .unwrap_or_else(|| panic!("no row for host {name}: {table}"));
    row.split("</tr>").next().unwrap_or(row)
}

/// Whether `text` holds a time of day `HH:MM:SS` right after `after`.
pub fn has_clock_after(text: &str, after: &str) -> bool {
    text.split(after).skip(1).any(|rest| {
        let b = rest.as_bytes();
        b.len() >= 8
            && [0, 1, 3, 4, 6, 7].iter().all(|&i| b[i].is_ascii_digit())
            && b[2] == b':'
            && b[5] == b':'
    })
}
