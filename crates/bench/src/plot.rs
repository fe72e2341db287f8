//! PNG plots of a run (plotters, bitmap back end; text drawn with a system
//! TrueType font, DejaVu Sans from Debian's fonts-dejavu-core).

use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::combinators::LogCoord;
use plotters::coord::ranged1d::ValueFormatter;
use plotters::prelude::*;
use plotters::style::FontStyle;

use super::results::{Results, Run};

/// One plot: its file (relative to the output directory) and whether it was drawn.
#[derive(Debug, Clone)]
pub struct PlotOut {
    pub file: String,
    pub title: String,
    pub ok: bool,
    pub message: String,
}

type DynErr = Box<dyn std::error::Error>;

/// ((system, pass), points) of one line.
type Series = ((String, String), Vec<(f64, f64)>);

const FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];

fn font() -> Result<(), String> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        for p in FONTS {
            if let Ok(b) = std::fs::read(p) {
                let b: &'static [u8] = Box::leak(b.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, b).is_ok() {
                    return Ok(());
                }
            }
        }
        Err("no TrueType font found (apt-get install fonts-dejavu-core)".into())
    })
    .clone()
}

const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(214, 39, 40),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

fn color(r: &Results, sys: &str, pass: &str) -> RGBColor {
    let i = r.systems.iter().position(|s| s.id == sys).unwrap_or(0);
    let c = PALETTE[i % PALETTE.len()];
    if pass == "library" {
        // Lighter shade for the library pass.
        RGBColor(c.0 / 2 + 100, c.1 / 2 + 100, c.2 / 2 + 100)
    } else {
        c
    }
}

fn label(r: &Results, sys: &str, pass: &str) -> String {
    let l = r
        .systems
        .iter()
        .find(|s| s.id == sys)
        .map(|s| s.label.clone())
        .unwrap_or_else(|| sys.to_string());
    if pass == "library" {
        format!("{l} [library]")
    } else {
        l
    }
}

/// (system, pass) series of a workload, sorted by x.
fn series<'a>(r: &'a Results, w: &str) -> Vec<((String, String), Vec<&'a Run>)> {
    let mut out: Vec<((String, String), Vec<&Run>)> = Vec::new();
    for x in r.runs.iter().filter(|x| x.workload == w && x.ok()) {
        let k = (x.system.clone(), x.pass.clone());
        match out.iter_mut().find(|(kk, _)| *kk == k) {
            Some((_, v)) => v.push(x),
            None => out.push((k, vec![x])),
        }
    }
    for (_, v) in out.iter_mut() {
        v.sort_by(|a, b| a.x.partial_cmp(&b.x).unwrap_or(std::cmp::Ordering::Equal));
    }
    out
}

fn bounds(vals: impl Iterator<Item = f64>) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::MAX, 0f64);
    for v in vals {
        if v > 0.0 {
            lo = lo.min(v);
            hi = hi.max(v);
        }
    }
    if hi <= 0.0 {
        (0.1, 1.0)
    } else {
        (lo / 1.5, hi * 1.5)
    }
}

/// A log-log (or log-x) line panel.
#[allow(clippy::too_many_arguments)]
fn line_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    r: &Results,
    title: &str,
    xdesc: &str,
    ydesc: &str,
    data: &[Series],
    logy: bool,
) -> Result<(), DynErr>
where
    DB::ErrorType: 'static,
{
    let (xlo, xhi) = bounds(data.iter().flat_map(|(_, v)| v.iter().map(|p| p.0)));
    let (ylo, yhi) = bounds(data.iter().flat_map(|(_, v)| v.iter().map(|p| p.1)));
    let mut b = ChartBuilder::on(area);
    b.caption(title, ("sans-serif", 18))
        .margin(8)
        .x_label_area_size(36)
        .y_label_area_size(64);
    let floor = if logy { ylo } else { 0.0 };
    if logy {
        let mut chart = b.build_cartesian_2d((xlo..xhi).log_scale(), (ylo..yhi).log_scale())?;
        draw_lines(&mut chart, r, xdesc, ydesc, data, floor)
    } else {
        let mut chart = b.build_cartesian_2d((xlo..xhi).log_scale(), 0f64..yhi)?;
        draw_lines(&mut chart, r, xdesc, ydesc, data, floor)
    }
}

fn draw_lines<'a, DB, Y>(
    chart: &mut ChartContext<'a, DB, Cartesian2d<LogCoord<f64>, Y>>,
    r: &Results,
    xdesc: &str,
    ydesc: &str,
    data: &[Series],
    floor: f64,
) -> Result<(), DynErr>
where
    DB: DrawingBackend + 'a,
    DB::ErrorType: 'static,
    Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    chart
        .configure_mesh()
        .x_desc(xdesc)
        .y_desc(ydesc)
        .x_label_formatter(&|v| num(*v))
        .y_label_formatter(&|v| num(*v))
        .light_line_style(RGBColor(235, 235, 235))
        .x_labels(8)
        .label_style(("sans-serif", 12))
        .draw()?;
    for ((sys, pass), pts) in data {
        let c = color(r, sys, pass);
        let pts: Vec<(f64, f64)> = pts.iter().map(|&(x, y)| (x, y.max(floor))).collect();
        chart
            .draw_series(LineSeries::new(
                pts.clone(),
                c.stroke_width(if pass == "library" { 1 } else { 2 }),
            ))?
            .label(label(r, sys, pass))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, c.filled())))?;
    }
    chart
        .configure_series_labels()
        .label_font(("sans-serif", 11))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    Ok(())
}

/// Axis numbers without a spurious ".0".
fn num(v: f64) -> String {
    if v.abs() >= 1e6 {
        format!("{:.0}M", v / 1e6)
    } else if v.abs() >= 1e4 {
        format!("{:.0}k", v / 1e3)
    } else if v.abs() >= 10.0 || v == 0.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn out(file: &str, title: &str, r: Result<(), DynErr>) -> PlotOut {
    PlotOut {
        file: file.into(),
        title: title.into(),
        ok: r.is_ok(),
        message: r.err().map(|e| e.to_string()).unwrap_or_default(),
    }
}

/// Draw every plot into `dir`.
pub fn all(r: &Results, dir: &Path) -> Vec<PlotOut> {
    if let Err(e) = font() {
        return [
            "fc_micro.png",
            "throughput.png",
            "fsync_cdf.png",
            "cost.png",
        ]
        .iter()
        .map(|f| PlotOut {
            file: f.to_string(),
            title: f.to_string(),
            ok: false,
            message: e.clone(),
        })
        .collect();
    }
    let mut v = Vec::new();
    if r.runs.iter().any(|x| x.workload == "fc-micro" && x.ok()) {
        v.push(out(
            "fc_micro.png",
            "Journal and device I/O vs fsync frequency (fc-micro)",
            fc_micro(r, &dir.join("fc_micro.png")),
        ));
    }
    if r.runs.iter().any(|x| {
        ["varmail-shared", "varmail-split", "fsmark", "dbench"].contains(&x.workload.as_str())
            && x.ok()
    }) {
        v.push(out(
            "throughput.png",
            "Throughput vs threads",
            throughput(r, &dir.join("throughput.png")),
        ));
    }
    if r.runs.iter().any(|x| x.result.fsync_lat.is_some()) {
        v.push(out(
            "fsync_cdf.png",
            "fsync latency CDF",
            cdf(r, &dir.join("fsync_cdf.png")),
        ));
    }
    if r.runs.iter().any(|x| x.ok() && x.pass == "mount") {
        v.push(out(
            "cost.png",
            "Provisioning cost per 1,000 application ops/s, relative to kernel ext4 (JBD2)",
            cost(r, &dir.join("cost.png")),
        ));
    }
    v
}

fn fc_micro(r: &Results, path: &Path) -> Result<(), DynErr> {
    let root = BitMapBackend::new(path, (1400, 1000)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((2, 2));
    let s = series(r, "fc-micro");
    type Get = fn(&Run) -> Option<f64>;
    let defs: [(&str, &str, Get); 4] = [
        (
            "Journal KiB written (device region / commitfs stats)",
            "KiB",
            |x| {
                x.journal
                    .map(|j| (j.journal_bytes + j.fc_bytes) as f64 / 1024.0)
                    .or_else(|| {
                        x.commitfs
                            .as_ref()
                            .map(|c| (c.journal_bytes + c.fc_bytes) as f64 / 1024.0)
                    })
            },
        ),
        ("Device KiB written", "KiB", |x| {
            Some(x.device.write_bytes as f64 / 1024.0)
        }),
        ("Device write I/Os", "writes", |x| {
            Some(x.device.writes as f64)
        }),
        ("Device cache flushes", "flushes", |x| {
            Some(x.device.flushes as f64)
        }),
    ];
    for (area, (title, ydesc, get)) in panels.iter().zip(defs.iter()) {
        let data: Vec<Series> = s
            .iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    v.iter().filter_map(|x| get(x).map(|y| (x.x, y))).collect(),
                )
            })
            .filter(|(_, v): &(_, Vec<(f64, f64)>)| !v.is_empty())
            .collect();
        line_panel(
            area,
            r,
            title,
            "fsync every n files (1,024 files)",
            ydesc,
            &data,
            true,
        )?;
    }
    root.present()?;
    Ok(())
}

fn throughput(r: &Results, path: &Path) -> Result<(), DynErr> {
    let root = BitMapBackend::new(path, (1400, 1000)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((2, 2));
    let defs = [
        (
            "varmail-shared (one directory)",
            "varmail-shared",
            "threads",
            "ops/s",
        ),
        (
            "varmail-split (a directory per thread)",
            "varmail-split",
            "threads",
            "ops/s",
        ),
        ("fs_mark -S 1", "fsmark", "threads", "files/s"),
        ("dbench", "dbench", "clients", "MB/s"),
    ];
    for (area, (title, w, xd, yd)) in panels.iter().zip(defs.iter()) {
        let data: Vec<Series> = series(r, w)
            .into_iter()
            .map(|(k, v)| (k, v.iter().map(|x| (x.x, x.result.throughput)).collect()))
            .collect();
        if data.is_empty() {
            area.titled(&format!("{title}: not run"), ("sans-serif", 18))?;
            continue;
        }
        line_panel(area, r, title, xd, yd, &data, false)?;
    }
    root.present()?;
    Ok(())
}

fn cdf(r: &Results, path: &Path) -> Result<(), DynErr> {
    let root = BitMapBackend::new(path, (1400, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((1, 2));
    let pick = |w: &str, max: bool| -> Vec<&Run> {
        let mut v: Vec<&Run> = r
            .runs
            .iter()
            .filter(|x| {
                x.workload == w && x.ok() && x.result.fsync_lat.is_some() && x.pass == "mount"
            })
            .collect();
        let target = v
            .iter()
            .map(|x| x.x)
            .fold(if max { f64::MIN } else { f64::MAX }, |a, b| {
                if max {
                    a.max(b)
                } else {
                    a.min(b)
                }
            });
        v.retain(|x| x.x == target);
        v
    };
    let defs = [
        ("fc-micro, fsync every file", pick("fc-micro", false)),
        ("varmail-shared, most threads", pick("varmail-shared", true)),
    ];
    for (area, (title, runs)) in panels.iter().zip(defs.iter()) {
        if runs.is_empty() {
            area.titled(&format!("{title}: not run"), ("sans-serif", 18))?;
            continue;
        }
        let (xlo, xhi) = bounds(runs.iter().flat_map(|x| {
            x.result
                .fsync_lat
                .iter()
                .flat_map(|l| l.cdf.iter().map(|p| p.0))
        }));
        let mut chart = ChartBuilder::on(area)
            .caption(*title, ("sans-serif", 18))
            .margin(8)
            .x_label_area_size(36)
            .y_label_area_size(50)
            .build_cartesian_2d((xlo..xhi).log_scale(), 0f64..1.0)?;
        chart
            .configure_mesh()
            .x_desc("fsync latency (µs)")
            .x_label_formatter(&|v| num(*v))
            .light_line_style(RGBColor(235, 235, 235))
            .y_desc("fraction of fsyncs")
            .label_style(("sans-serif", 12))
            .draw()?;
        for x in runs {
            let c = color(r, &x.system, &x.pass);
            let pts: Vec<(f64, f64)> = x
                .result
                .fsync_lat
                .as_ref()
                .map(|l| l.cdf.iter().map(|&(a, b)| (a.max(xlo), b)).collect())
                .unwrap_or_default();
            chart
                .draw_series(LineSeries::new(pts, c.stroke_width(2)))?
                .label(format!("{} ({})", label(r, &x.system, &x.pass), x.variant))
                .legend(move |(a, b)| {
                    PathElement::new(vec![(a, b), (a + 18, b)], c.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .label_font(("sans-serif", 11))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::LowerRight)
            .draw()?;
    }
    root.present()?;
    Ok(())
}

fn cost(r: &Results, path: &Path) -> Result<(), DynErr> {
    // One group per workload (its point with the most sync pressure), one bar
    // per system: provisioning cost per 1,000 app ops/s relative to the
    // reference system (kernel ext4 with JBD2, as in the paper).
    let reference = if r.runs.iter().any(|x| x.system == "ext4") {
        "ext4".to_string()
    } else {
        r.runs.first().map(|x| x.system.clone()).unwrap_or_default()
    };
    let mut groups: Vec<(String, Vec<&Run>, f64)> = Vec::new();
    let mut seen: Vec<&str> = Vec::new();
    for x in r.runs.iter().filter(|x| x.pass == "mount" && x.ok()) {
        if seen.contains(&x.workload.as_str()) {
            continue;
        }
        seen.push(&x.workload);
        let Some(v) = super::report::cost_variant(r, &x.workload) else {
            continue;
        };
        let runs: Vec<&Run> = r
            .runs
            .iter()
            .filter(|y| y.pass == "mount" && y.ok() && y.workload == x.workload && y.variant == v)
            .collect();
        let base = runs
            .iter()
            .find(|y| y.system == reference)
            .map(|y| y.cost.per_kops_usd)
            .unwrap_or(0.0);
        if base > 0.0 {
            groups.push((format!("{} {}", x.workload, v), runs, base));
        }
    }
    let systems: Vec<String> = r
        .systems
        .iter()
        .filter(|s| {
            r.runs
                .iter()
                .any(|x| x.system == s.id && x.pass == "mount" && x.ok())
        })
        .map(|s| s.id.clone())
        .collect();
    let ymax = groups
        .iter()
        .flat_map(|(_, v, base)| v.iter().map(move |x| x.cost.per_kops_usd / base))
        .fold(1.0, f64::max)
        * 1.15;
    let root = BitMapBackend::new(path, (1400, 620)).into_drawing_area();
    root.fill(&WHITE)?;
    let ng = groups.len().max(1);
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "Provisioned IOPS + MB/s cost per 1,000 application ops/s, relative to {}",
                label(r, &reference, "mount")
            ),
            ("sans-serif", 18),
        )
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(0f64..ng as f64, 0f64..ymax)?;
    let names: Vec<String> = groups.iter().map(|(n, _, _)| n.clone()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(ng * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - x.floor() - 0.5).abs() < 0.01 && i < names.len() {
                names[i].clone()
            } else {
                String::new()
            }
        })
        .y_label_formatter(&|v| format!("{v:.1}x"))
        .y_desc("cost relative to the reference (1.0)")
        .label_style(("sans-serif", 11))
        .draw()?;
    chart.draw_series(std::iter::once(PathElement::new(
        vec![(0.0, 1.0), (ng as f64, 1.0)],
        BLACK.stroke_width(1),
    )))?;
    let ns = systems.len().max(1) as f64;
    let bw = 0.8 / ns;
    for (si, sys) in systems.iter().enumerate() {
        let c = color(r, sys, "mount");
        let bars: Vec<Rectangle<(f64, f64)>> = groups
            .iter()
            .enumerate()
            .filter_map(|(gi, (_, v, base))| {
                v.iter().find(|x| &x.system == sys).map(|x| {
                    let x0 = gi as f64 + 0.1 + si as f64 * bw;
                    Rectangle::new(
                        [(x0, 0.0), (x0 + bw * 0.9, x.cost.per_kops_usd / base)],
                        c.filled(),
                    )
                })
            })
            .collect();
        chart
            .draw_series(bars)?
            .label(label(r, sys, "mount"))
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], c.filled()));
    }
    chart
        .configure_series_labels()
        .label_font(("sans-serif", 11))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    root.present()?;
    Ok(())
}
