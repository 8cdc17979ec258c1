//! Command-line arguments.

use std::ffi::OsString;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::{EXIT_CODES_HELP, Failure};

/// Cluster-wide locks on PostgreSQL advisory locks.
#[derive(Debug, Parser)]
#[command(name = "distlock", version, about, after_long_help = EXIT_CODES_HELP)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Run a command while holding a cluster-wide lock (a distributed flock(1)).
    ///
    /// Exits with the command's exit code when it ran, 75 when the lock is
    /// held elsewhere, 124 when --wait ran out, 76 when the lock was lost
    /// while the command ran (the command is stopped). See --help for all codes.
    ///
    /// The command runs in a process group of its own: forwarded signals
    /// (SIGINT, SIGTERM, SIGHUP) and the terminal's stops reach everything
    /// it started in that group, and nothing left in the group is running
    /// when the lock is released (a stop or signal sent to distlock alone,
    /// and a process that leaves the group, are beyond it: see the README).
    Run(RunArgs),
    /// List the sessions holding or awaiting advisory locks in the database
    /// (with --lease-table, the live leases of distlock.leases).
    Holders(HoldersArgs),
}

/// Where the locks live.
#[derive(Debug, Args)]
pub(crate) struct ConnArgs {
    /// PostgreSQL connection URL; its password is never printed.
    // hide_env_values: `--help` would otherwise print the URL, password included.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, value_name = "URL")]
    pub(crate) database_url: Option<String>,

    /// Use Redis instead of PostgreSQL: once for a single instance (with a
    /// watchdog-extended lease), several times for Redlock over independent
    /// nodes (e.g. five). From the environment (which, unlike the command
    /// line, other users cannot read in /proc), several URLs are separated
    /// by spaces; a password is never printed. Which backend: a URL on the
    /// command line beats one from the environment (--database-url beats
    /// DISTLOCK_REDIS_URL); from the same place, Redis beats the database,
    /// except that both on the command line is a usage error (64).
    /// `holders` is PostgreSQL only: it ignores DISTLOCK_REDIS_URL and
    /// refuses --redis-url.
    // hide_env_values: `--help` would otherwise print the URLs, passwords included.
    #[arg(
        long = "redis-url",
        value_name = "URL",
        env = "DISTLOCK_REDIS_URL",
        hide_env_values = true,
        value_delimiter = ' '
    )]
    pub(crate) redis_urls: Vec<String>,

    /// Keep the lock as a lease in the table distlock.leases instead of a
    /// session-level advisory lock: for a DATABASE_URL that goes through a
    /// transaction pooler (PgBouncer in transaction mode), where a session
    /// lock cannot be held. Every statement is one short transaction; the
    /// lease lives three --heartbeat (renewed every quarter of that) and
    /// expires three heartbeats after its last renewal if distlock dies. The command always gets a fencing
    /// token. Needs the distlock schema (see `distlock::migrate`). With
    /// `holders`: list the table's live leases instead of advisory locks.
    /// DISTLOCK_LEASE_TABLE takes 1, true, yes, on, y, t (or 0, false, no,
    /// off, n, f), in any case; anything else is a usage error (64).
    // No `conflicts_with = "redis_urls"`: clap counts a value from the
    // environment as given, an "off" one too, so DISTLOCK_LEASE_TABLE=0
    // would refuse every Redis run; `chosen` checks what was asked for.
    #[arg(
        long,
        env = "DISTLOCK_LEASE_TABLE",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub(crate) lease_table: bool,

    /// Which of the URLs came from the command line (filled in by [`parse`]).
    #[arg(skip)]
    pub(crate) on_command_line: OnCommandLine,
}

/// Which connection URLs were given on the command line rather than taken
/// from the environment.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct OnCommandLine {
    pub(crate) database_url: bool,
    pub(crate) redis_urls: bool,
}

/// The backend the connection arguments name.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Chosen<'a> {
    /// PostgreSQL at this URL.
    Postgres(&'a str),
    /// One Redis instance, or Redlock over several.
    Redis(&'a [String]),
}

impl ConnArgs {
    /// The backend to use: a URL on the command line beats one from the
    /// environment, so that a `DISTLOCK_REDIS_URL` exported for other jobs
    /// cannot turn `--database-url`'s lock into a Redis lease that other
    /// hosts (without the variable) do not see; from the same place Redis
    /// beats the database (the environment's documented order), and both
    /// on the command line name two backends, a usage error. So is
    /// `--lease-table` (a PostgreSQL mode) with Redis.
    pub(crate) fn chosen(&self) -> Result<Chosen<'_>, Failure> {
        let given = self.on_command_line;
        let chosen = match (self.redis_urls.is_empty(), self.database_url.as_deref()) {
            (false, Some(_)) if given.redis_urls && given.database_url => {
                return Err(Failure::usage(
                    "--redis-url and --database-url name two backends: pass one",
                ));
            }
            (false, Some(url)) if given.database_url => Chosen::Postgres(url),
            (false, _) => Chosen::Redis(&self.redis_urls),
            (true, Some(url)) => Chosen::Postgres(url),
            (true, None) => {
                return Err(Failure::usage(
                    "no database: pass --database-url or set DATABASE_URL",
                ));
            }
        };
        if self.lease_table && matches!(chosen, Chosen::Redis(_)) {
            return Err(Failure::usage(
                "--lease-table (or DISTLOCK_LEASE_TABLE) is a PostgreSQL mode: \
                 it cannot be used with Redis",
            ));
        }
        Ok(chosen)
    }

    /// The same arguments without the Redis URLs of the environment, for a
    /// PostgreSQL-only command; Redis URLs on its command line are a usage
    /// error.
    pub(crate) fn postgres_only(&self, command: &str) -> Result<Self, Failure> {
        if self.on_command_line.redis_urls {
            return Err(Failure::usage(format!(
                "`{command}` is PostgreSQL only: drop --redis-url"
            )));
        }
        Ok(Self {
            database_url: self.database_url.clone(),
            redis_urls: Vec::new(),
            lease_table: self.lease_table,
            on_command_line: self.on_command_line,
        })
    }
}

/// Parses `args` (the program's name first), noting which connection URLs
/// came from the command line.
pub(crate) fn parse<I, T>(args: I) -> Result<Cli, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    use clap::parser::ValueSource;
    use clap::{CommandFactory, FromArgMatches};
    let matches = Cli::command().try_get_matches_from(args)?;
    let mut cli = Cli::from_arg_matches(&matches)?;
    if let Some((_, sub)) = matches.subcommand() {
        let given = |id: &str| sub.value_source(id) == Some(ValueSource::CommandLine);
        let conn = match &mut cli.command {
            Command::Run(args) => &mut args.conn,
            Command::Holders(args) => &mut args.conn,
        };
        conn.on_command_line = OnCommandLine {
            database_url: given("database_url"),
            redis_urls: given("redis_urls"),
        };
    }
    Ok(cli)
}

#[derive(Debug, Args)]
pub(crate) struct RunArgs {
    /// The lock's name (locks hashtext(KEY), as `distlock::LockKey::from`).
    pub(crate) key: String,

    /// Wait up to this long for the lock (e.g. 30s, 500ms, 2m) instead of
    /// exiting with 75 at once when it is held elsewhere. Durations longer
    /// than 100 years (here and below) count as 100 years. On PostgreSQL a
    /// wait lasts at most about 24.8 days (the server's longest
    /// lock_timeout), then exits 124 as at its deadline.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub(crate) wait: Option<Duration>,

    /// After the lock is lost (or when the command exits leaving processes
    /// in its process group), and after a SIGTERM forwarded to the command:
    /// how long the group may take to exit after SIGTERM before it gets
    /// SIGKILL.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    pub(crate) grace: Duration,

    /// How often the lock's connection is checked (with --lease-table: the
    /// lease lives three heartbeats and is renewed every three quarters of
    /// one); a lost lock is noticed within about twice this. Default 1s; for a session lock at least 10ms and at
    /// most 10s, with --lease-table about 34ms to 8h (three heartbeats must
    /// make a TTL of 100ms to 24h); refused with 64 otherwise. PostgreSQL
    /// only: refused (64) with
    /// --redis-url, whose leases their watchdog extends every third of the
    /// TTL.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub(crate) heartbeat: Option<Duration>,

    /// Take the lock with a fencing token, passed to the command in
    /// DISTLOCK_FENCING_TOKEN (PostgreSQL; needs the distlock schema, see
    /// `distlock::migrate`). A single Redis instance and --lease-table
    /// always issue one; Redlock cannot.
    #[arg(long)]
    pub(crate) fencing: bool,

    /// No messages and no progress line (errors are still printed).
    #[arg(short, long)]
    pub(crate) quiet: bool,

    #[command(flatten)]
    pub(crate) conn: ConnArgs,

    /// The command to run, after `--`.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub(crate) command: Vec<OsString>,
}

#[derive(Debug, Args)]
pub(crate) struct HoldersArgs {
    /// Only the holders of this lock name (with --lease-table, the lease a
    /// run of this name would find).
    pub(crate) key: Option<String>,

    /// Print JSON (an array of objects) instead of a table.
    #[arg(long, conflicts_with = "tree")]
    pub(crate) json: bool,

    /// Draw who waits for whom: each holder that waits for nothing, with
    /// the sessions waiting for it indented below it, and theirs below them;
    /// sessions that wait for each other (a deadlock not broken yet) are
    /// drawn as a cycle. Not with --lease-table, whose waiters leave no
    /// trace.
    #[arg(long)]
    pub(crate) tree: bool,

    #[command(flatten)]
    pub(crate) conn: ConnArgs,
}

/// The longest duration an option takes; longer ones are cut to it. A
/// century is as good as forever here, and adding it to the clock cannot
/// overflow (adding e.g. 500000000000 years to an `Instant` panics).
const LONGEST: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);

/// Parses `30s`, `500ms`, `2m`, `1h 30m` (humantime's syntax), saturating
/// at [`LONGEST`].
fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim())
        .map(|duration| duration.min(LONGEST))
        .map_err(|err| format!("{err} (examples: 30s, 500ms, 2m)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_like_people_write_them() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h 30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("500000000000years"), Ok(LONGEST));
        assert_eq!(parse_duration("18446744073709551615s"), Ok(LONGEST));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn the_command_comes_after_a_double_dash() {
        let cli = Cli::try_parse_from([
            "distlock", "run", "nightly", "--wait", "5s", "--", "sh", "-c", "echo hi",
        ])
        .expect("parses");
        let Command::Run(run) = cli.command else {
            panic!("expected run");
        };
        assert_eq!(run.key, "nightly");
        assert_eq!(run.wait, Some(Duration::from_secs(5)));
        assert_eq!(run.command, ["sh", "-c", "echo hi"]);
        assert!(Cli::try_parse_from(["distlock", "run", "nightly"]).is_err());
    }

    fn conn(database: Option<&str>, redis: &[&str], given: (bool, bool)) -> ConnArgs {
        ConnArgs {
            database_url: database.map(str::to_owned),
            redis_urls: redis.iter().map(|url| (*url).to_owned()).collect(),
            lease_table: false,
            on_command_line: OnCommandLine {
                database_url: given.0,
                redis_urls: given.1,
            },
        }
    }

    #[test]
    fn a_url_on_the_command_line_beats_the_environment() {
        let db = Some("postgres://db");
        let redis = ["redis://r"];
        let pick = |args: ConnArgs| match args.chosen() {
            Ok(Chosen::Postgres(_)) => "postgres",
            Ok(Chosen::Redis(_)) => "redis",
            Err(_) => "refused",
        };
        assert_eq!(pick(conn(db, &redis, (false, false))), "redis");
        assert_eq!(pick(conn(db, &redis, (true, false))), "postgres");
        assert_eq!(pick(conn(db, &redis, (false, true))), "redis");
        assert_eq!(pick(conn(db, &redis, (true, true))), "refused");
        assert_eq!(pick(conn(db, &[], (false, false))), "postgres");
        assert_eq!(pick(conn(None, &redis, (false, false))), "redis");
        assert_eq!(pick(conn(None, &[], (false, false))), "refused");
        let mut table = conn(db, &redis, (false, false));
        table.lease_table = true;
        assert_eq!(pick(table), "refused");
        let mut table = conn(db, &redis, (true, false));
        table.lease_table = true;
        assert_eq!(pick(table), "postgres");
    }

    #[test]
    fn parse_notes_which_urls_came_from_the_command_line() {
        let cli = parse([
            "distlock",
            "run",
            "--database-url",
            "postgres://db",
            "k",
            "--",
            "true",
        ])
        .expect("parses");
        let Command::Run(run) = cli.command else {
            panic!("expected run");
        };
        assert!(run.conn.on_command_line.database_url);
        assert!(!run.conn.on_command_line.redis_urls);
        let cli = parse(["distlock", "holders", "--redis-url", "redis://r"]).expect("parses");
        let Command::Holders(holders) = cli.command else {
            panic!("expected holders");
        };
        assert!(holders.conn.on_command_line.redis_urls);
        assert!(holders.conn.postgres_only("holders").is_err());
    }

    #[test]
    fn clap_configuration_is_valid() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
