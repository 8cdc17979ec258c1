//! Which parts of a run to measure: `cargo bench --bench locks -- WORD...`.
//!
//! A word names a section (see [`SECTIONS`]) or picks rows: the cycles
//! whose short label contains it (`table`, `multi`, `session`,
//! `PgAdvisoryLock`, ...; with the references their ratios need), or the
//! scale row groups whose name contains it (`holders`, `past the limit`,
//! `lock_all`, `multiplex`, `semaphore`, `TableLocker`). Row words apply to the sections named
//! beside them, and to the uncontended cycles when none is named: `table`
//! runs the two lease-table cycles (and `PgAdvisoryLock`), `0.5ms table`
//! the same over the delaying proxy, `scale table` only the `TableLocker`
//! rows of the scale section. Case does not matter. No word runs
//! everything. A filtered run prints its tables and writes no file:
//! `docs/bench/` keeps the last full run.

/// The sections a word can name, in the order of a run.
pub const SECTIONS: [&str; 10] = [
    "interleaved",
    "cold",
    "cycles",
    "current-thread",
    "hops",
    "0.5ms",
    "handoff",
    "kinds",
    "many",
    "scale",
];

/// The words given, lower-cased.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    words: Vec<String>,
}

impl Filter {
    /// The words among `args` (the program's arguments, the program
    /// itself first): every argument that is not an option (`--x`) nor the
    /// value of `--rounds` or `--idle-us`.
    pub fn from_args(args: &[String]) -> Self {
        let mut words = Vec::new();
        let mut skip_value = false;
        for arg in args.iter().skip(1) {
            if skip_value {
                skip_value = false;
            } else if arg == "--rounds" || arg == "--idle-us" {
                skip_value = true;
            } else if !arg.starts_with("--") {
                words.push(arg.to_lowercase());
            }
        }
        Self { words }
    }

    /// Whether any word was given.
    pub fn is_set(&self) -> bool {
        !self.words.is_empty()
    }

    /// Whether section `name` runs: no filter, a word names it, or (the
    /// uncontended cycles) words pick rows and none names a section.
    pub fn section(&self, name: &str) -> bool {
        let named = |n: &str| self.words.iter().any(|w| w == n);
        !self.is_set() || named(name) || (name == "cycles" && !SECTIONS.iter().any(|s| named(s)))
    }

    /// Whether a word (not a section's name) is part of `label`.
    pub fn row(&self, label: &str) -> bool {
        let label = label.to_lowercase();
        self.row_words().any(|w| label.contains(w))
    }

    /// Whether any word picks rows rather than naming a section.
    pub fn picks_rows(&self) -> bool {
        self.row_words().next().is_some()
    }

    fn row_words(&self) -> impl Iterator<Item = &str> {
        self.words
            .iter()
            .map(String::as_str)
            .filter(|w| !SECTIONS.contains(w))
    }

    /// Whether a scale row group `name` runs: the scale section runs, and
    /// either no word picks rows or one is part of `name`.
    pub fn scale_row(&self, name: &str) -> bool {
        !self.picks_rows() || self.row(name)
    }

    /// The words, for the report's heading.
    pub fn describe(&self) -> String {
        self.words.join(" ")
    }
}
