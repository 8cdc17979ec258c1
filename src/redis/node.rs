//! One Redis server: a reconnecting connection, a label for logs, and
//! commands under a deadline.

use std::fmt;
use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, Cmd, ErrorKind, FromRedisValue, RedisError, ServerErrorKind};
use tokio::time::{Instant, timeout_at};

use crate::Error;

/// How long establishing a TCP connection to a server may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// A server and the multiplexed connection to it. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Node {
    conn: ConnectionManager,
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
        let conn = ConnectionManager::new_with_config(client, config()).await?;
        Ok(Self { conn, label })
    }

    /// Connects on first use, so that a server that is down now can still
    /// take part once it comes up (Redlock tolerates absent nodes).
    pub(crate) fn lazy(client: Client) -> Result<Self, Error> {
        let label = label(&client);
        let conn = ConnectionManager::new_lazy_with_config(client, config())?;
        Ok(Self { conn, label })
    }

    /// `host:port/db`, without credentials.
    pub(crate) fn label(&self) -> &str {
        &self.label
    }

    /// Sends `cmd` and waits for its reply until `within` has passed; then
    /// fails with an I/O "timed out" error (see `RedisError::is_timeout`).
    ///
    /// A command that found the connection refused is sent once more within
    /// the same deadline: the manager has started to reconnect by then, so a
    /// server that just came back answers at once. This is safe because a
    /// refused command never left this process.
    pub(crate) async fn query<T: FromRedisValue>(
        &self,
        cmd: &Cmd,
        within: Duration,
    ) -> Result<T, RedisError> {
        let deadline = deadline(Instant::now(), within);
        let first = timeout_at(deadline, self.send(cmd)).await;
        match first {
            Ok(Err(err)) if err.is_connection_refusal() => timeout_at(deadline, self.send(cmd))
                .await
                .unwrap_or_else(|_| Err(timed_out(within))),
            Ok(result) => result,
            Err(_) => Err(timed_out(within)),
        }
    }

    async fn send<T: FromRedisValue>(&self, cmd: &Cmd) -> Result<T, RedisError> {
        let mut conn = self.conn.clone();
        cmd.query_async(&mut conn).await
    }
}

/// No retries inside the manager: every caller has its own deadline, and a
/// failed command already makes the manager reconnect in the background.
fn config() -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_number_of_retries(0)
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
}

fn label(client: &Client) -> Arc<str> {
    let info = client.get_connection_info();
    Arc::from(format!("{}/{}", info.addr(), info.redis_settings().db()))
}

/// `start + after`, or, when that is beyond what the clock can express (such
/// as `Duration::MAX`), the latest instant it can (within a factor of two):
/// as long as possible, without overflowing.
pub(crate) fn deadline(start: Instant, after: Duration) -> Instant {
    let mut after = after;
    loop {
        if let Some(deadline) = start.checked_add(after) {
            return deadline;
        }
        after /= 2;
    }
}

/// The error of a command that got no reply in time.
pub(crate) fn timed_out(after: Duration) -> RedisError {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("no reply from Redis within {after:?}"),
    )
    .into()
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

/// Runs `futures` concurrently on the calling task and returns their outputs
/// in order. Talking to every node at once keeps a Redlock round as slow as
/// its slowest node, not as the sum of all of them.
pub(crate) async fn join_all<F: Future>(futures: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    let mut pending: Vec<Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = pending.iter().map(|_| None).collect();
    poll_fn(|cx| {
        let mut done = true;
        for (future, output) in pending.iter_mut().zip(outputs.iter_mut()) {
            if output.is_none() {
                match future.as_mut().poll(cx) {
                    Poll::Ready(value) => *output = Some(value),
                    Poll::Pending => done = false,
                }
            }
        }
        if done { Poll::Ready(()) } else { Poll::Pending }
    })
    .await;
    outputs.into_iter().flatten().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadlines_saturate() {
        let now = Instant::now();
        let second = Duration::from_secs(1);
        assert_eq!(deadline(now, second), now + second);
        let far = deadline(now, Duration::MAX);
        assert!(far > now + Duration::from_secs(100 * 365 * 24 * 3600));
        assert!(deadline(now, Duration::from_secs(u64::MAX / 2)) > now + second);
    }

    #[test]
    fn connection_failures_and_restarts_are_transient_the_rest_is_not() {
        let io = |kind| RedisError::from(std::io::Error::new(kind, "x"));
        for err in [
            io(std::io::ErrorKind::ConnectionRefused),
            io(std::io::ErrorKind::ConnectionReset),
            io(std::io::ErrorKind::BrokenPipe),
            timed_out(Duration::from_millis(1)),
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
    }
}
