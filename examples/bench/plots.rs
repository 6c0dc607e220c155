//! The report's charts, drawn as SVG strings with plotters (its SVG backend
//! writes text as `<text>` elements, so no font is needed to draw them).

use std::time::Duration;

use plotters::coord::ranged1d::SegmentValue;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::Res;

/// One chart of a section: the file it is written to (next to the report,
/// in the report's plot directory) and its SVG.
pub struct Plot {
    /// File name, `*.svg`.
    pub file: String,
    /// What the image shows (its alt text).
    pub alt: String,
    /// The SVG document.
    pub svg: String,
}

const WIDTH: u32 = 1000;
/// Tick labels and axis descriptions.
const LABELS: (&str, u32) = ("sans-serif", 14);
const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];
const FLOOR: RGBColor = RGBColor(127, 127, 127);

/// A row's name as a chart label: up to its first `:` (what it is, without
/// how), or else up to its first parenthesis.
pub fn short(name: &str) -> &str {
    let cut = name
        .find(':')
        .or_else(|| name.find(" ("))
        .unwrap_or(name.len());
    name[..cut].trim()
}

/// Cumulative distributions of handoff latency, one line per row, on a
/// logarithmic time axis. Rows without samples are left out.
pub fn latency_cdf(file: &str, title: &str, rows: &[(String, &[Duration])]) -> Res<Plot> {
    let series: Vec<(&str, Vec<(f64, f64)>)> = rows
        .iter()
        .filter(|(_, samples)| !samples.is_empty())
        .map(|(name, samples)| (name.as_str(), cdf(samples)))
        .collect();
    let all = || {
        series
            .iter()
            .flat_map(|(_, points)| points.iter().map(|p| p.0))
    };
    let lo = all().fold(f64::INFINITY, f64::min).max(1.0);
    let hi = all().fold(1.0, f64::max).max(lo * 10.0);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, 480)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(56)
            .build_cartesian_2d((lo * 0.8..hi * 1.25).log_scale(), 0f64..1f64)?;
        chart
            .configure_mesh()
            .label_style(LABELS)
            .axis_desc_style(LABELS)
            .x_desc("handoff latency (µs, logarithmic)")
            .y_desc("share of handoffs at most this long")
            .x_label_formatter(&|us| format!("{us:.0}"))
            .draw()?;
        for (i, (name, points)) in series.into_iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            chart
                .draw_series(LineSeries::new(points, color.stroke_width(2)))?
                .label(name)
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .label_font(LABELS)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
    }
    Ok(Plot {
        file: file.into(),
        alt: title.into(),
        svg,
    })
}

/// The samples' cumulative distribution in µs, at most 400 points.
fn cdf(samples: &[Duration]) -> Vec<(f64, f64)> {
    let mut us: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e6).collect();
    us.sort_by(f64::total_cmp);
    let n = us.len();
    let step = n.div_ceil(400).max(1);
    let mut points: Vec<(f64, f64)> = (0..n)
        .step_by(step)
        .map(|i| (us[i].max(1.0), (i + 1) as f64 / n as f64))
        .collect();
    points.push((us[n - 1].max(1.0), 1.0));
    points
}

/// One bar of a bar chart, with an optional range drawn over it.
pub struct Bar {
    pub label: String,
    pub value: f64,
    pub range: Option<(f64, f64)>,
    /// The text written at the bar's end.
    pub note: String,
    /// The reference row the others are read against (drawn grey).
    pub reference: bool,
}

/// Horizontal bars in panels stacked one over the other, each with its own
/// value axis: `panels` is (panel title, bars).
pub fn bars(file: &str, title: &str, value_desc: &str, panels: &[(String, Vec<Bar>)]) -> Res<Plot> {
    let heights: Vec<u32> = panels
        .iter()
        .map(|(_, bars)| 90 + 34 * bars.len() as u32)
        .collect();
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, 40 + heights.iter().sum::<u32>()))
            .into_drawing_area();
        root.fill(&WHITE)?;
        let root = root.titled(title, ("sans-serif", 20))?;
        let mut rest = root;
        for ((panel, bars), height) in panels.iter().zip(&heights) {
            let (area, below) = rest.split_vertically(*height);
            rest = below;
            draw_panel(&area, panel, value_desc, bars)?;
        }
        rest.present()?;
    }
    Ok(Plot {
        file: file.into(),
        alt: title.into(),
        svg,
    })
}

fn draw_panel(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    panel: &str,
    value_desc: &str,
    bars: &[Bar],
) -> Res<()> {
    let max = bars
        .iter()
        .map(|b| b.range.map_or(b.value, |r| r.1).max(b.value))
        .fold(0.0, f64::max)
        .max(1e-9);
    // The first bar on top: segment `n - 1 - i` holds bar `i`.
    let n = bars.len().max(1);
    let labels: Vec<String> = bars.iter().rev().map(|b| b.label.clone()).collect();
    let longest = labels.iter().map(|l| l.chars().count()).max().unwrap_or(0);
    let mut chart = ChartBuilder::on(area)
        .caption(panel, ("sans-serif", 17))
        .margin(8)
        .x_label_area_size(40)
        .y_label_area_size(longest as u32 * 8 + 24)
        .build_cartesian_2d(0f64..max * 1.3, (0..n).into_segmented())?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(n)
        .y_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => labels.get(*i).cloned().unwrap_or_default(),
            _ => String::new(),
        })
        .label_style(LABELS)
        .axis_desc_style(LABELS)
        .x_label_formatter(&|v| tick(*v, max))
        .x_desc(value_desc)
        .draw()?;
    let at = |i: usize| n - 1 - i;
    chart.draw_series(bars.iter().enumerate().map(|(i, b)| {
        let color = if b.reference {
            FLOOR
        } else {
            COLORS[i % COLORS.len()]
        };
        let mut bar = Rectangle::new(
            [
                (0.0, SegmentValue::Exact(at(i))),
                (b.value, SegmentValue::Exact(at(i) + 1)),
            ],
            color.filled(),
        );
        bar.set_margin(5, 5, 0, 0);
        bar
    }))?;
    chart.draw_series(bars.iter().enumerate().filter_map(|(i, b)| {
        b.range.map(|(lo, hi)| {
            PathElement::new(
                [
                    (lo, SegmentValue::CenterOf(at(i))),
                    (hi, SegmentValue::CenterOf(at(i))),
                ],
                BLACK.stroke_width(2),
            )
        })
    }))?;
    chart.draw_series(bars.iter().enumerate().map(|(i, b)| {
        let end = b.range.map_or(b.value, |r| r.1).max(b.value);
        Text::new(
            format!(" {}", b.note),
            (end, SegmentValue::CenterOf(at(i))),
            TextStyle::from(LABELS.into_font()).pos(Pos::new(HPos::Left, VPos::Center)),
        )
    }))?;
    Ok(())
}

/// A tick label of an axis running from 0 to `max`: no decimals unless the
/// axis is short.
fn tick(v: f64, max: f64) -> String {
    if max >= 20.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}
