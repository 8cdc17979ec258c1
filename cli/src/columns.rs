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

/// How long before now `time` was, in whole seconds (`3m 12s`); `None` for a
/// time this machine's clock puts in the future.
pub(crate) fn ago(time: SystemTime) -> Option<String> {
    let age = SystemTime::now().duration_since(time).ok()?;
    Some(humantime::format_duration(Duration::from_secs(age.as_secs())).to_string())
}
