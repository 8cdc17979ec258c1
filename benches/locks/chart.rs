//! Two small hand-written SVG charts (no plotting dependency).

use std::fmt::Write;

const COLORS: [&str; 6] = [
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#b07aa1",
];

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// One series of a grouped bar chart: per group, the bar value (p50) and
/// the whisker's top (p99).
pub struct Series {
    pub name: String,
    pub points: Vec<Option<(f64, f64)>>,
}

/// Grouped bars on a logarithmic axis: bars are p50, whiskers reach p99.
pub fn grouped_log(title: &str, unit: &str, groups: &[String], series: &[Series]) -> String {
    let (w, h) = (760.0, 420.0);
    let (left, right, top, bottom) = (70.0, 190.0, 40.0, 50.0);
    let plot_w = w - left - right;
    let plot_h = h - top - bottom;
    let values = series
        .iter()
        .flat_map(|s| s.points.iter().flatten())
        .flat_map(|&(a, b)| [a, b]);
    let (lo, hi) = values.fold((f64::INFINITY, 0.0_f64), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    let lo_exp = lo.max(1e-3).log10().floor();
    let hi_exp = hi.max(1e-3).log10().ceil().max(lo_exp + 1.0);
    let y = |v: f64| top + plot_h * (1.0 - (v.max(1e-3).log10() - lo_exp) / (hi_exp - lo_exp));
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = write!(svg, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = write!(
        svg,
        r#"<text x="{}" y="22" font-size="15" text-anchor="middle">{}</text>"#,
        left + plot_w / 2.0,
        escape(title)
    );
    let mut e = lo_exp;
    while e <= hi_exp {
        let v = 10f64.powf(e);
        let yy = y(v);
        let _ = write!(
            svg,
            r##"<line x1="{left}" x2="{}" y1="{yy:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{} {unit}</text>"##,
            left + plot_w,
            left - 6.0,
            yy + 4.0,
            format_value(v)
        );
        e += 1.0;
    }
    let group_w = plot_w / groups.len() as f64;
    let bar_w = group_w * 0.8 / series.len() as f64;
    for (g, group) in groups.iter().enumerate() {
        let gx = left + group_w * g as f64;
        let _ = write!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            gx + group_w / 2.0,
            top + plot_h + 20.0,
            escape(group)
        );
        for (s, serie) in series.iter().enumerate() {
            let Some(Some((p50, p99))) = serie.points.get(g) else {
                continue;
            };
            let x = gx + group_w * 0.1 + bar_w * s as f64;
            let (y50, y99, base) = (y(*p50), y(*p99), top + plot_h);
            let color = COLORS[s % COLORS.len()];
            let _ = write!(
                svg,
                r##"<rect x="{x:.1}" y="{y50:.1}" width="{:.1}" height="{:.1}" fill="{color}"><title>{}: p50 {} {unit}, p99 {} {unit}</title></rect>"##,
                bar_w * 0.9,
                (base - y50).max(0.5),
                escape(&serie.name),
                format_value(*p50),
                format_value(*p99)
            );
            let cx = x + bar_w * 0.45;
            let _ = write!(
                svg,
                r##"<line x1="{cx:.1}" x2="{cx:.1}" y1="{y50:.1}" y2="{y99:.1}" stroke="#333"/><line x1="{:.1}" x2="{:.1}" y1="{y99:.1}" y2="{y99:.1}" stroke="#333"/>"##,
                cx - bar_w * 0.25,
                cx + bar_w * 0.25
            );
        }
    }
    let _ = write!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">waiters</text>"#,
        left + plot_w / 2.0,
        h - 10.0
    );
    legend(
        &mut svg,
        w - right + 15.0,
        top,
        series.iter().map(|s| s.name.as_str()),
    );
    let _ = write!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" font-size="11">bar: p50, whisker: p99</text>"#,
        w - right + 15.0,
        top + 22.0 * series.len() as f64 + 14.0
    );
    svg.push_str("</svg>\n");
    svg
}

/// Horizontal bars, one per row, with a label at the end of each bar.
pub fn hbars(title: &str, unit: &str, rows: &[(String, f64, String)]) -> String {
    let (w, row_h) = (760.0, 30.0);
    let (left, right, top) = (250.0, 150.0, 40.0);
    let h = top + row_h * rows.len() as f64 + 30.0;
    let plot_w = w - left - right;
    let max = rows.iter().map(|r| r.1).fold(0.0_f64, f64::max).max(1e-9);
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = write!(svg, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = write!(
        svg,
        r#"<text x="{}" y="22" font-size="15" text-anchor="middle">{}</text>"#,
        w / 2.0,
        escape(title)
    );
    for (i, (name, value, label)) in rows.iter().enumerate() {
        let yy = top + row_h * i as f64;
        let len = plot_w * value / max;
        let color = COLORS[usize::from(name.starts_with("session")) % COLORS.len()];
        let _ = write!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text><rect x="{left}" y="{:.1}" width="{len:.1}" height="{:.1}" fill="{color}"/><text x="{:.1}" y="{:.1}">{} {unit} · {}</text>"#,
            left - 8.0,
            yy + row_h * 0.6,
            escape(name),
            yy + 4.0,
            row_h - 8.0,
            left + len + 6.0,
            yy + row_h * 0.6,
            format_value(*value),
            escape(label)
        );
    }
    svg.push_str("</svg>\n");
    svg
}

fn legend<'a>(svg: &mut String, x: f64, y: f64, names: impl Iterator<Item = &'a str>) {
    for (i, name) in names.enumerate() {
        let yy = y + 22.0 * i as f64;
        let _ = write!(
            svg,
            r#"<rect x="{x:.1}" y="{yy:.1}" width="12" height="12" fill="{}"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            COLORS[i % COLORS.len()],
            x + 18.0,
            yy + 10.0,
            escape(name)
        );
    }
}

fn format_value(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}
