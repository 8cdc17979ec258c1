//! Histories: every process appends one JSON object per line to its own file
//! in the run's directory; the checker reads them all afterwards.
//!
//! A line always has `t` (CLOCK_MONOTONIC, ns), `p` (process index: workers
//! count from 0, the test process that injects faults is [`CONTROL`]) and
//! `e` (the event). Operations of a worker carry `w` (task) and `s` (the
//! task's operation number), so `(p, w, s)` names one operation; `k` is the
//! key index, `m` the method. Events:
//!
//! | event | meaning |
//! |---|---|
//! | `invoke` | an acquisition is called (`m`: `try`, `lock`, `xact`, `xwait`) |
//! | `busy`, `timeout` | it returned without the lock |
//! | `failed` | it (or, after `entered`, its transaction) failed (`r`: error) |
//! | `acquired` | the lock was granted (`tok`: fencing token, `bp`: backend pid) |
//! | `entered`, `exited` | the critical section begins / ends |
//! | `released` | release (or commit) confirmed |
//! | `lost` | `lost()` completed, or release reported the lock lost (`r`) |
//! | `release_failed` | release returned another error (`r`) |
//! | `read`, `write` | register read (`v`) and acknowledged write (`v`: new value) |
//! | `read_rejected`, `write_rejected` | the fence refused a stale token |
//! | `reg_failed` | a register statement failed, outcome unknown (`r`) |
//! | `fault` | injected by the control process (`kind`, optional `bp`/`target`) |
//! | `leakcheck` | a worker's own advisory locks after all its guards ended (`n`) |
//! | `done` | a worker finished |
//!
//! `entered` and `exited` reach the file before the section starts (and
//! before the lock is released), so a history survives `kill -9`: a killed
//! process leaves at most one torn last line, which [`load`] skips.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde_json::{Map, Value};

use super::clock::now_ns;

/// Process index of the test process itself (fault injection).
pub const CONTROL: i64 = -1;

/// Appends events of one process to its history file.
#[derive(Debug)]
pub struct Recorder {
    proc: i64,
    out: Mutex<BufWriter<File>>,
}

impl Recorder {
    /// A recorder writing `dir/history-<proc>.jsonl`.
    pub fn create(dir: &Path, proc: i64) -> Self {
        let path = history_path(dir, proc);
        let file = File::create(&path).unwrap_or_else(|e| panic!("create {path:?}: {e}"));
        Self {
            proc,
            out: Mutex::new(BufWriter::with_capacity(1 << 16, file)),
        }
    }

    /// Records `event` now, with the fields in `fields` (an object).
    pub fn emit(&self, event: &str, fields: Value) -> u64 {
        let t = now_ns();
        let mut obj = match fields {
            Value::Object(obj) => obj,
            Value::Null => Map::new(),
            other => panic!("event fields must be an object, got {other}"),
        };
        obj.insert("t".into(), t.into());
        obj.insert("p".into(), self.proc.into());
        obj.insert("e".into(), event.into());
        let line = Value::Object(obj).to_string();
        let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        writeln!(out, "{line}").expect("write history");
        // A section's bounds must be on disk before the section starts (or
        // the lock is released): a process killed inside it still leaves
        // `entered` behind, and one killed after it leaves `exited`.
        if matches!(event, "entered" | "exited") {
            out.flush().expect("flush history");
        }
        t
    }

    /// Writes buffered events to the file.
    pub fn flush(&self) {
        let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        out.flush().expect("flush history");
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        if let Ok(out) = self.out.get_mut() {
            let _ = out.flush();
        }
    }
}

fn history_path(dir: &Path, proc: i64) -> PathBuf {
    if proc == CONTROL {
        dir.join("history-control.jsonl")
    } else {
        dir.join(format!("history-{proc}.jsonl"))
    }
}

/// One recorded event.
#[derive(Debug, Clone)]
pub struct Event {
    pub t: u64,
    pub p: i64,
    pub e: String,
    pub fields: Map<String, Value>,
}

impl Event {
    pub fn int(&self, name: &str) -> Option<i64> {
        self.fields.get(name).and_then(Value::as_i64)
    }

    pub fn text(&self, name: &str) -> Option<&str> {
        self.fields.get(name).and_then(Value::as_str)
    }

    /// The operation this event belongs to, if it belongs to one.
    pub fn op(&self) -> Option<(i64, i64, i64)> {
        Some((self.p, self.int("w")?, self.int("s")?))
    }
}

/// Reads every history file in `dir`, sorted by time. The last line of a
/// file may be torn (its process was killed while writing it) and is then
/// skipped; a bad line anywhere else is an error.
pub fn load(dir: &Path) -> Vec<Event> {
    let mut events = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {dir:?}: {e}"))
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("history-") && n.ends_with(".jsonl"))
        })
        .collect();
    entries.sort();
    for path in entries {
        let file = File::open(&path).unwrap_or_else(|e| panic!("open {path:?}: {e}"));
        events.extend(
            parse_lines(BufReader::new(file))
                .unwrap_or_else(|(n, line)| panic!("{path:?} line {n}: {line}")),
        );
    }
    events.sort_by_key(|e| e.t);
    events
}

/// The events of one history, skipping a torn last line (a line without its
/// newline that does not parse). `Err((line number, line))` for any other
/// line that does not parse.
pub fn parse_lines(mut input: impl BufRead) -> Result<Vec<Event>, (usize, String)> {
    let mut events = Vec::new();
    let mut n = 0;
    loop {
        let mut raw = Vec::new();
        let read = input.read_until(b'\n', &mut raw).unwrap_or(0);
        if read == 0 {
            break;
        }
        n += 1;
        let complete = raw.last() == Some(&b'\n');
        let line = String::from_utf8_lossy(&raw).trim_end().to_owned();
        if line.is_empty() {
            continue;
        }
        match serde_json::from_str(&line).ok().and_then(parse) {
            Some(event) => events.push(event),
            None if !complete => break, // torn by a kill: the last line
            None => return Err((n, line)),
        }
    }
    Ok(events)
}

fn parse(value: Value) -> Option<Event> {
    let Value::Object(mut fields) = value else {
        return None;
    };
    let t = fields.remove("t")?.as_u64()?;
    let p = fields.remove("p")?.as_i64()?;
    let e = fields.remove("e")?.as_str()?.to_owned();
    Some(Event { t, p, e, fields })
}
