//! One Redis server: a reconnecting connection, a label for logs, and
//! commands under a deadline.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, Cmd, ErrorKind, FromRedisValue, RedisError, ServerErrorKind};
use tokio::time::timeout_at;

use crate::{Error, deadline};

/// How long establishing a TCP connection to a server may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// A server and the multiplexed connection to it. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Node {
    conn: Arc<Mutex<Manager>>,
    /// For connections of other kinds (the release signals' subscriber).
    client: Client,
    label: Arc<str>,
}

impl fmt::Debug for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label)
    }
}

impl Node {
    /// Connects now; fails if the server does not answer.
    pub(crate) async fn connect(client: Client) -> Result<Self, Error> {
        let label = label(&client);
        let conn = ConnectionManager::new_with_config(client.clone(), config()).await?;
        Ok(Self::with(conn, client, label))
    }

    fn with(conn: ConnectionManager, client: Client, label: Arc<str>) -> Self {
        let manager = Manager {
            generation: 0,
            conn,
        };
        Self {
            conn: Arc::new(Mutex::new(manager)),
            client,
            label,
        }
    }

    /// Connects on first use, so that a server that is down now can still
    /// take part once it comes up (Redlock tolerates absent nodes).
    pub(crate) fn lazy(client: Client) -> Result<Self, Error> {
        let label = label(&client);
        let conn = ConnectionManager::new_lazy_with_config(client.clone(), config())?;
        Ok(Self::with(conn, client, label))
    }

    /// `host:port/db`, without credentials.
    pub(crate) fn label(&self) -> &str {
        &self.label
    }

    /// The client the node was set up with.
    pub(crate) fn client(&self) -> &Client {
        &self.client
    }

    /// Sends `cmd` and waits for its reply until `within` has passed; then
    /// fails with [`Failure::TimedOut`].
    ///
    /// A command that found the connection refused is sent once more within
    /// the same deadline: the manager has started to reconnect by then, so a
    /// server that just came back answers at once. This is safe because a
    /// refused command never left this process.
    pub(crate) async fn query<T: FromRedisValue>(
        &self,
        cmd: &Cmd,
        within: Duration,
    ) -> Result<T, Failure> {
        let deadline = deadline::from_now(within);
        let first = timeout_at(deadline, self.send(cmd)).await;
        let reply = match first {
            Ok(Err(err)) if err.is_connection_refusal() => {
                timeout_at(deadline, self.send(cmd)).await
            }
            first => first,
        };
        match reply {
            Ok(result) => result.map_err(Failure::Redis),
            Err(_) => Err(Failure::TimedOut(within)),
        }
    }

    async fn send<T: FromRedisValue>(&self, cmd: &Cmd) -> Result<T, RedisError> {
        let (generation, mut conn) = {
            let manager = self.manager();
            (manager.generation, manager.conn.clone())
        };
        let reply = cmd.query_async(&mut conn).await;
        if let Err(err) = &reply
            && !err.is_io_error()
        {
            self.start_over(generation);
        }
        reply
    }

    fn manager(&self) -> std::sync::MutexGuard<'_, Manager> {
        self.conn.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Replaces the manager of `generation` (unless another command did
    /// already) with one that connects at the next command. A manager
    /// starts a new connection only after an I/O error or a dropped
    /// connection; a reconnect whose set-up the server refused (`AUTH`
    /// after a password change, `-ERR max number of clients reached`, a
    /// `SELECT` during a long script) stays its answer to every later
    /// command, and the node would be out for good. Any other error may be
    /// such a refusal, so after any other error the node starts over: at
    /// worst one connection more, on a path that failed anyway.
    fn start_over(&self, generation: u64) {
        let fresh = match ConnectionManager::new_lazy_with_config(self.client.clone(), config()) {
            Ok(fresh) => fresh,
            Err(err) => {
                tracing::debug!(node = %self.label, %err, "distlock: could not set up a new Redis connection");
                return;
            }
        };
        let mut manager = self.manager();
        if manager.generation == generation {
            manager.generation += 1;
            manager.conn = fresh;
        }
    }
}

/// The node's connection manager, and how many times it was replaced.
struct Manager {
    generation: u64,
    conn: ConnectionManager,
}

/// No retries inside the manager: every caller has its own deadline, and a
/// failed command already makes the manager reconnect in the background
/// (or the node start over, see [`Node::start_over`]).
/// No response timeout either: redis-rs's default (500 ms) would cut every
/// command short of a longer deadline the user set (the single instance's
/// default is 2 s), and report it as an I/O error instead of
/// [`Failure::TimedOut`].
fn config() -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_number_of_retries(0)
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_response_timeout(None)
}

fn label(client: &Client) -> Arc<str> {
    let info = client.get_connection_info();
    Arc::from(format!("{}/{}", info.addr(), info.redis_settings().db()))
}

/// Why a command to one server did not get its reply.
#[derive(Debug)]
pub(crate) enum Failure {
    /// No reply within the deadline (the command may still take effect).
    TimedOut(Duration),
    /// The client or the server reported an error.
    Redis(RedisError),
}

impl Failure {
    /// Whether sending the command again may succeed: see [`is_transient`].
    pub(crate) fn is_transient(&self) -> bool {
        match self {
            Self::TimedOut(_) => true,
            Self::Redis(err) => is_transient(err),
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TimedOut(after) => write!(f, "no reply within {after:?}"),
            Self::Redis(err) => err.fmt(f),
        }
    }
}

/// Whether a command that failed with `err` may succeed if sent again: the
/// connection failed, was refused or reset, or got no reply in time; or the
/// server is starting (`LOADING`), busy with a script (`BUSY`), or in the
/// middle of a failover (`READONLY`, `MASTERDOWN`, `TRYAGAIN`,
/// `CLUSTERDOWN`, `NOREPLICAS`).
///
/// Everything else is permanent: a wrong type, a script error, failed
/// authentication or a missing permission, a server out of memory or unable
/// to persist (`OOM`, `MISCONF`). Trying again would only hide it until the
/// deadline.
pub(crate) fn is_transient(err: &RedisError) -> bool {
    match err.kind() {
        ErrorKind::Io | ErrorKind::Parse => true,
        ErrorKind::Server(kind) => matches!(
            kind,
            ServerErrorKind::BusyLoading
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::MasterDown
                | ServerErrorKind::ReadOnly
        ),
        ErrorKind::Extension => matches!(err.code(), Some("BUSY" | "NOREPLICAS")),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_failures_and_restarts_are_transient_the_rest_is_not() {
        let io = |kind| RedisError::from(std::io::Error::new(kind, "x"));
        for err in [
            io(std::io::ErrorKind::ConnectionRefused),
            io(std::io::ErrorKind::ConnectionReset),
            io(std::io::ErrorKind::BrokenPipe),
            io(std::io::ErrorKind::TimedOut),
            RedisError::from((ErrorKind::Server(ServerErrorKind::BusyLoading), "loading")),
            RedisError::from((ErrorKind::Server(ServerErrorKind::ReadOnly), "replica")),
            RedisError::from((ErrorKind::Server(ServerErrorKind::MasterDown), "down")),
            redis::make_extension_error("BUSY".into(), None),
        ] {
            assert!(is_transient(&err), "{err}");
        }
        for err in [
            RedisError::from((ErrorKind::Server(ServerErrorKind::ResponseError), "wrong")),
            RedisError::from((ErrorKind::Server(ServerErrorKind::NoPerm), "denied")),
            RedisError::from((ErrorKind::Server(ServerErrorKind::NoScript), "gone")),
            RedisError::from((ErrorKind::AuthenticationFailed, "wrong password")),
            RedisError::from((ErrorKind::UnexpectedReturnType, "not an integer")),
            redis::make_extension_error("WRONGTYPE".into(), None),
            redis::make_extension_error("WRONGPASS".into(), None),
            redis::make_extension_error("OOM".into(), None),
        ] {
            assert!(!is_transient(&err), "{err}");
        }
        assert!(Failure::TimedOut(Duration::from_millis(1)).is_transient());
    }
}
