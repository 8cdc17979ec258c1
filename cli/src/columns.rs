//! Text tables: rows of cells in aligned columns, and how long ago a time
//! shown in one was.

use std::time::{Duration, SystemTime};

/// `rows` (the header first) as lines of cells padded to their column's
/// widest, two spaces apart, without trailing blanks.
pub(crate) fn aligned(rows: &[Vec<String>]) -> String {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|col| {
            rows.iter()
                .filter_map(|r| r.get(col))
                .map(|cell| cell.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in rows {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// `time` as RFC 3339 (whole seconds, UTC) with how long ago it was,
/// `2026-12-06T07:50:00Z (3m 12s ago)`: the SINCE cell of both `holders`
/// tables. The age is by this machine's clock, which may differ from the
/// server's that wrote the time; a time that clock puts in the future has
/// no age.
pub(crate) fn since(time: SystemTime) -> String {
    let at = humantime::format_rfc3339_seconds(time);
    match ago(time) {
        Some(age) => format!("{at} ({age} ago)"),
        None => at.to_string(),
    }
}

/// How long before now `time` was, in whole seconds (`3m 12s`); `None` for a
/// time this machine's clock puts in the future.
pub(crate) fn ago(time: SystemTime) -> Option<String> {
    let age = SystemTime::now().duration_since(time).ok()?;
    Some(humantime::format_duration(Duration::from_secs(age.as_secs())).to_string())
}
