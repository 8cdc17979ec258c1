//! Turning the connection arguments into a lock backend.
//!
//! This is the one place that knows which backends exist: commands get an
//! `Arc<dyn Locker>` (plus the PostgreSQL locker where a command needs
//! PostgreSQL-only features such as naming holders). One `--redis-url` picks
//! a single Redis instance, several pick Redlock over them.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use distlock::postgres::TableLocker;
use distlock::redis::{RedisLocker, Redlock};
use distlock::{Locker, PgLocker};
use redis::{ConnectionAddr, IntoConnectionInfo};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::Failure;
use crate::args::{Chosen, ConnArgs};
use crate::redact::{redact_url, user_info_cut_short, user_info_needs_encoding};

/// The lock backend chosen by the arguments.
#[derive(Debug, Clone)]
pub(crate) struct Backend {
    /// Hands out the leases.
    pub(crate) locker: Arc<dyn Locker>,
    /// The same locker when the backend is PostgreSQL (holders, wait reports).
    pub(crate) postgres: Option<PgLocker>,
    /// The same locker when it is the lease table (its live leases).
    pub(crate) table: Option<TableLocker>,
}

/// Connects to the backend named by `conn`. `application` becomes the
/// sessions' `application_name`, so `distlock holders` (and `pg_stat_activity`)
/// show what a lock is held for. `heartbeat` is the session lock's check
/// interval. With `fencing`, every PostgreSQL lock comes with a fencing token
/// (a single Redis instance always issues one; Redlock cannot).
pub(crate) async fn connect(
    conn: &ConnArgs,
    application: &str,
    heartbeat: Duration,
    fencing: bool,
) -> Result<Backend, Failure> {
    let url = match conn.chosen()? {
        Chosen::Redis(urls) => {
            if fencing && urls.len() > 1 {
                return Err(Failure::usage(
                    "--fencing: Redlock (several --redis-url) issues no fencing tokens; \
                     use PostgreSQL or a single Redis instance",
                ));
            }
            check_redis_urls(urls).await?;
            return connect_redis(urls).await;
        }
        Chosen::Postgres(url) => url,
    };
    let target = redact_url(url);
    // Refused before it is parsed: where what precedes the delimiter reads
    // as a port (`app:?secret@db`, `app:5432?secret@db`), the URL parses,
    // as host `app` and a query holding the rest of the password, which
    // the driver then logs as an unknown parameter.
    const ENCODE: &str = "a '#', '?' or '/' in the user name or password must be \
                          percent-encoded: %23, %3F, %2F";
    if user_info_cut_short(url) {
        return Err(Failure::usage(format!(
            "invalid database URL {target}: {ENCODE}"
        )));
    }
    let options = PgConnectOptions::from_str(url)
        .map_err(|err| {
            let hint = if user_info_needs_encoding(url) {
                format!(" ({ENCODE})")
            } else {
                String::new()
            };
            Failure::usage(format!("invalid database URL {target}: {err}{hint}"))
        })?
        .application_name(&truncate_name(application));
    if conn.lease_table {
        return connect_lease_table(options, &target, heartbeat).await;
    }
    let pool = PgPoolOptions::new()
        // One connection holds the lock, one looks up holders while waiting.
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(10))
        .connect_lazy_with(options);
    // The settings first: a usage error is one whether or not the server
    // answers.
    let locker = PgLocker::builder(pool.clone())
        .heartbeat(heartbeat)
        .fencing(fencing)
        .build()
        .map_err(|err| Failure::usage(format!("--heartbeat: {err}")))?;
    pool.acquire()
        .await
        .map_err(|err| Failure::unavailable(format!("could not connect to {target}: {err}")))?;
    Ok(Backend {
        locker: Arc::new(locker.clone()),
        postgres: Some(locker),
        table: None,
    })
}

/// Leases in the table `distlock.leases`, through whatever sits in front of
/// PostgreSQL: the lease's TTL is three heartbeats, so it expires three
/// heartbeats after its last renewal (the locker renews every quarter of
/// the TTL). A heartbeat whose TTL the locker cannot keep is a usage error,
/// as an out-of-range heartbeat of a session lock is. Statements are not cached
/// (the README's PgBouncer recipe), and waits poll instead of listening,
/// since `LISTEN` needs a session a transaction pooler does not keep.
async fn connect_lease_table(
    options: PgConnectOptions,
    target: &str,
    heartbeat: Duration,
) -> Result<Backend, Failure> {
    let ttl = lease_ttl(heartbeat)?;
    let pool = PgPoolOptions::new()
        // One connection renews, one releases.
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options.statement_cache_capacity(0))
        .await
        .map_err(|err| Failure::unavailable(format!("could not connect to {target}: {err}")))?;
    let locker = TableLocker::builder(pool)
        .ttl(ttl)
        .listen(false)
        .build()
        .map_err(|err| Failure::usage(format!("--heartbeat: {err}")))?;
    Ok(Backend {
        locker: Arc::new(locker.clone()),
        postgres: None,
        table: Some(locker),
    })
}

/// The TTL of a lease renewed by `heartbeat`: three heartbeats, refused
/// (before connecting) when that is outside the lease table's range rather
/// than changed to fit.
fn lease_ttl(heartbeat: Duration) -> Result<Duration, Failure> {
    use distlock::postgres::{MAX_TTL, MIN_TTL};
    let ttl = heartbeat.saturating_mul(3);
    if ttl < MIN_TTL || ttl > MAX_TTL {
        return Err(Failure::usage(format!(
            "--heartbeat {}: with --lease-table the lease lives three heartbeats, \
             which must come to {} to {} (a heartbeat of about {} to {})",
            humantime::format_duration(heartbeat),
            humantime::format_duration(MIN_TTL),
            humantime::format_duration(MAX_TTL),
            humantime::format_duration(whole_millis(MIN_TTL / 3, true)),
            humantime::format_duration(whole_millis(MAX_TTL / 3, false)),
        )));
    }
    Ok(ttl)
}

/// `duration` in whole milliseconds, rounded `up` or down, so that a range
/// reads `34ms`, not `33ms 333us 333ns`.
fn whole_millis(duration: Duration, up: bool) -> Duration {
    let millis = duration.as_millis();
    let rounded = if up && !duration.subsec_nanos().is_multiple_of(1_000_000) {
        millis.saturating_add(1)
    } else {
        millis
    };
    Duration::from_millis(u64::try_from(rounded).unwrap_or(u64::MAX))
}

/// Refuses, as usage errors (before connecting), Redis URLs that are empty
/// (`DISTLOCK_REDIS_URL="   "` splits into empty entries), that do not
/// parse, or that name one server twice: Redlock counts a quorum of
/// independent nodes, and one server spelled two ways (`127.0.0.1` and
/// `localhost`) would be counted twice (with two URLs, its second "node"
/// always finds the key taken, so every run reported "held elsewhere").
/// Host names are resolved, each within 5 s; one that does not resolve is
/// compared by its spelling (Redlock lets a node that is down join later).
async fn check_redis_urls(urls: &[String]) -> Result<(), Failure> {
    if urls.iter().any(|url| url.trim().is_empty()) {
        return Err(Failure::usage(
            "an empty Redis URL: give each --redis-url a URL, and separate several \
             URLs in DISTLOCK_REDIS_URL by single spaces",
        ));
    }
    let mut seen: Vec<(String, HashSet<Place>)> = Vec::with_capacity(urls.len());
    for url in urls {
        let target = redact_url(url);
        let info = url
            .as_str()
            .into_connection_info()
            .map_err(|err| Failure::usage(format!("invalid Redis URL {target}: {err}")))?;
        if urls.len() == 1 {
            return Ok(());
        }
        let places = places(info.addr()).await;
        if let Some((earlier, _)) = seen.iter().find(|(_, other)| !other.is_disjoint(&places)) {
            return Err(Failure::usage(format!(
                "--redis-url {earlier} and {target} name the same Redis server; \
                 Redlock needs independent nodes (give each server once)"
            )));
        }
        seen.push((target, places));
    }
    Ok(())
}

/// Where a Redis server listens, to tell Redlock's nodes apart.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Place {
    Socket(SocketAddr),
    /// A host name that did not resolve, lower-cased, and its port.
    Name(String, u16),
    Path(PathBuf),
}

/// Every address `addr` stands for.
async fn places(addr: &ConnectionAddr) -> HashSet<Place> {
    match addr {
        ConnectionAddr::Tcp(host, port) | ConnectionAddr::TcpTls { host, port, .. } => {
            let bare = host.trim_start_matches('[').trim_end_matches(']');
            let resolved = tokio::time::timeout(
                Duration::from_secs(5),
                tokio::net::lookup_host((bare, *port)),
            )
            .await;
            let places: HashSet<Place> = match resolved {
                Ok(Ok(addrs)) => addrs.map(Place::Socket).collect(),
                _ => HashSet::new(),
            };
            if places.is_empty() {
                return HashSet::from([Place::Name(bare.to_ascii_lowercase(), *port)]);
            }
            places
        }
        ConnectionAddr::Unix(path) => {
            let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.clone());
            HashSet::from([Place::Path(path)])
        }
        // A kind of address this version does not know: nothing to compare.
        _ => HashSet::new(),
    }
}

/// A single Redis instance for one URL, Redlock over several.
async fn connect_redis(urls: &[String]) -> Result<Backend, Failure> {
    let targets: Vec<String> = urls.iter().map(|url| redact_url(url)).collect();
    let locker: Arc<dyn Locker> = match urls {
        [url] => Arc::new(RedisLocker::connect(url).await.map_err(|err| {
            Failure::unavailable(format!(
                "could not connect to {}: {err}",
                targets.join(", ")
            ))
        })?),
        _ => {
            let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
            Arc::new(Redlock::connect(&urls).await.map_err(|err| {
                Failure::unavailable(format!(
                    "could not connect to {}: {err}",
                    targets.join(", ")
                ))
            })?)
        }
    };
    Ok(Backend {
        locker,
        postgres: None,
        table: None,
    })
}

/// PostgreSQL keeps 63 bytes of `application_name`; cut at a character
/// boundary rather than let the server cut through one.
fn truncate_name(name: &str) -> String {
    let mut end = name.len().min(63);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    name[..end].to_owned()
}

#[cfg(test)]
mod tests {
    use super::truncate_name;

    #[test]
    fn application_names_are_cut_at_a_character_boundary() {
        assert_eq!(
            truncate_name("distlock run nightly"),
            "distlock run nightly"
        );
        let long = format!("distlock run {}", "é".repeat(40));
        let cut = truncate_name(&long);
        assert!(cut.len() <= 63);
        assert!(long.starts_with(&cut));
    }
}
