//! Small PNG charts (plotters, with an embedded DejaVu font so no system
//! font is needed). Plotters draws into an RGB buffer and the `png` crate
//! encodes it: plotters' own encoder pulls in the whole `image` crate.

use anyhow::{anyhow, Context};
use plotters::prelude::*;
use std::path::Path;
use std::sync::Once;

/// A named line.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// One panel of a figure.
pub struct Panel {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
}

const COLORS: [RGBColor; 5] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
];

fn fonts() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            dejavu::sans::regular(),
        );
    });
}

fn range(vals: impl Iterator<Item = f64> + Clone) -> (f64, f64) {
    let lo = vals.clone().fold(f64::INFINITY, f64::min);
    let hi = vals.fold(f64::NEG_INFINITY, f64::max);
    if !lo.is_finite() || !hi.is_finite() {
        return (0.0, 1.0);
    }
    let pad = if hi - lo < 1e-12 {
        (lo.abs() * 0.05).max(0.5)
    } else {
        (hi - lo) * 0.05
    };
    (lo - pad, hi + pad)
}

/// Draw `panels` side by side into a PNG at `path`.
pub fn save_png(path: &Path, panels: &[Panel]) -> anyhow::Result<()> {
    fonts();
    let (width, height) = (560 * panels.len().max(1) as u32, 420);
    let mut buf = vec![0u8; width as usize * height as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
        let areas = root.split_evenly((1, panels.len().max(1)));
        for (area, p) in areas.iter().zip(panels) {
            let xs = p.series.iter().flat_map(|s| s.points.iter().map(|q| q.0));
            let ys = p.series.iter().flat_map(|s| s.points.iter().map(|q| q.1));
            let (x0, x1) = range(xs.clone());
            let (y0, y1) = range(ys.clone());
            let mut chart = ChartBuilder::on(area)
                .caption(&p.title, ("sans-serif", 20))
                .margin(12)
                .x_label_area_size(40)
                .y_label_area_size(56)
                .build_cartesian_2d(x0..x1, y0..y1)
                .map_err(|e| anyhow!("{e}"))?;
            chart
                .configure_mesh()
                .x_desc(&p.x_label)
                .y_desc(&p.y_label)
                .label_style(("sans-serif", 13))
                .draw()
                .map_err(|e| anyhow!("{e}"))?;
            for (i, s) in p.series.iter().enumerate() {
                let c = COLORS[i % COLORS.len()];
                chart
                    .draw_series(LineSeries::new(s.points.iter().copied(), c.stroke_width(2)))
                    .map_err(|e| anyhow!("{e}"))?
                    .label(&s.name)
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2))
                    });
                // Markers, so that short series (one epoch) still show.
                if s.points.len() <= 50 {
                    chart
                        .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, c.filled())))
                        .map_err(|e| anyhow!("{e}"))?;
                }
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .label_font(("sans-serif", 13))
                .draw()
                .map_err(|e| anyhow!("{e}"))?;
        }
        root.present().map_err(|e| anyhow!("{e}"))?;
    }
    write_png(path, &buf, width, height)
}

/// Encode an RGB buffer as a PNG at `path`, atomically (temporary file, then
/// rename), so a chart is never left half-written.
fn write_png(path: &Path, rgb: &[u8], width: u32, height: u32) -> anyhow::Result<()> {
    let tmp = path.with_file_name(format!(
        ".{}.tmp{}",
        path.file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("plot.png"),
        std::process::id()
    ));
    let write = || -> anyhow::Result<()> {
        let file = std::fs::File::create(&tmp)?;
        let mut enc = png::Encoder::new(std::io::BufWriter::new(file), width, height);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let mut w = enc.write_header()?;
        w.write_image_data(rgb)?;
        w.finish()?;
        std::fs::rename(&tmp, path)?;
        Ok(())
    };
    write()
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
        .with_context(|| format!("writing {}", path.display()))
}

/// Horizontal bars of `speedup` per row (Voltaic against its peer), with
/// the parity line at 1 and a `target` mark where a row has one.
pub fn save_speedups(
    path: &Path,
    title: &str,
    rows: &[(String, f64, Option<f64>)],
) -> anyhow::Result<()> {
    fonts();
    let n = rows.len().max(1);
    let (width, height) = (900, 90 + 34 * n as u32);
    let mut buf = vec![0u8; width as usize * height as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
        let xmax = rows
            .iter()
            .flat_map(|r| [r.1, r.2.unwrap_or(0.0)])
            .fold(1.2f64, f64::max)
            * 1.1;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(250)
            .build_cartesian_2d(0.0..xmax, (0..n).into_segmented())
            .map_err(|e| anyhow!("{e}"))?;
        let names: Vec<String> = rows.iter().map(|r| r.0.clone()).collect();
        chart
            .configure_mesh()
            .disable_y_mesh()
            .x_desc("speedup (peer time / Voltaic time; > 1: Voltaic faster)")
            .y_label_formatter(&|y: &SegmentValue<usize>| match y {
                SegmentValue::CenterOf(i) | SegmentValue::Exact(i) => {
                    names.get(*i).cloned().unwrap_or_default()
                }
                SegmentValue::Last => String::new(),
            })
            .label_style(("sans-serif", 13))
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .draw_series(rows.iter().enumerate().map(|(i, r)| {
                let c = if r.2.is_some_and(|t| r.1 < t) {
                    COLORS[1]
                } else {
                    COLORS[0]
                };
                let mut bar = Rectangle::new(
                    [
                        (0.0, SegmentValue::Exact(i)),
                        (r.1, SegmentValue::Exact(i + 1)),
                    ],
                    c.filled(),
                );
                bar.set_margin(5, 5, 0, 0);
                bar
            }))
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(1.0, SegmentValue::Exact(0)), (1.0, SegmentValue::Last)],
                BLACK.stroke_width(1),
            )))
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .draw_series(rows.iter().enumerate().filter_map(|(i, r)| {
                let t = r.2?;
                Some(PathElement::new(
                    vec![(t, SegmentValue::Exact(i)), (t, SegmentValue::Exact(i + 1))],
                    COLORS[3].stroke_width(3),
                ))
            }))
            .map_err(|e| anyhow!("{e}"))?;
        root.present().map_err(|e| anyhow!("{e}"))?;
    }
    write_png(path, &buf, width, height)
}
