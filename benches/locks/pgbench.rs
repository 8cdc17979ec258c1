//! The reference rate for hot-key hand-offs: `pgbench` with a two-statement
//! script (`pg_advisory_lock(k)`; `pg_advisory_unlock(k)`), when installed.

use std::path::PathBuf;
use std::process::Command;

use sqlx::postgres::PgConnectOptions;

/// Finds `pgbench` on `PATH` or in PostgreSQL's versioned bin directories.
pub fn find() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("pgbench"))
            .find(|p| p.is_file())
    });
    on_path.or_else(|| {
        let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
            .ok()?
            .filter_map(|e| e.ok())
            .map(|e| e.path().join("bin/pgbench"))
            .filter(|p| p.is_file())
            .collect();
        found.sort();
        found.pop()
    })
}

/// Runs `clients` pgbench clients for `seconds` on the hot key; returns
/// lock/unlock pairs (= hand-offs) per second, or why it could not run.
pub fn run(
    pgbench: &PathBuf,
    opts: &PgConnectOptions,
    database: &str,
    clients: usize,
    seconds: u64,
) -> Result<f64, String> {
    let script = std::env::temp_dir().join(format!("distlock-bench-{}.sql", std::process::id()));
    std::fs::write(
        &script,
        "SELECT pg_advisory_lock(4299);\nSELECT pg_advisory_unlock(4299);\n",
    )
    .map_err(|e| e.to_string())?;
    let output = Command::new(pgbench)
        .args(["-n", "-M", "prepared", "-f"])
        .arg(&script)
        .args(["-c", &clients.to_string()])
        .args(["-j", &clients.min(2).to_string()])
        .args(["-T", &seconds.to_string()])
        .args(["-h", opts.get_host()])
        .args(["-p", &opts.get_port().to_string()])
        .args(["-U", opts.get_username()])
        .arg(database)
        .output()
        .map_err(|e| e.to_string())?;
    let _ = std::fs::remove_file(&script);
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(String::from_utf8_lossy(&output.stderr).trim().to_owned());
    }
    stdout
        .lines()
        .find_map(|line| {
            let rest = line.strip_prefix("tps = ")?;
            rest.split_whitespace().next()?.parse::<f64>().ok()
        })
        .ok_or_else(|| format!("no tps line in pgbench output: {stdout}"))
}
