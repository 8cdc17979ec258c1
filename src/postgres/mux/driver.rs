//! The task that owns one shared connection: it runs every lock and unlock
//! statement for the locks pinned to it, one heartbeat per interval for all
//! of them, and declares them all lost at once when the connection fails.

use std::collections::HashMap;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{ConnectOptions, Connection};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::{sleep_until, timeout};

use super::request::{Granted, Inbox, Request, Ticket, TryError, TryOutcome};
use super::sql::{self, ServerKey};
use crate::postgres::keeper::FIRST_HEARTBEAT;
use crate::postgres::pooler::{PoolerCheck, loss_reason, shared_session};
use crate::postgres::sqlstate::{connect_error, locking_error, sqlstate};
use crate::{Error, LockKey, LossReason};

/// Settings a driver needs.
#[derive(Clone)]
pub(super) struct DriverConfig {
    pub(super) connect: PgConnectOptions,
    pub(super) connect_timeout: Duration,
    pub(super) heartbeat: Duration,
    /// Deadline of every statement on the shared connection, heartbeat or
    /// not: a connection that stalls cannot vouch for any of its locks.
    pub(super) statement_timeout: Duration,
}

/// Written by hand: `PgConnectOptions`' own `Debug` prints the password.
impl std::fmt::Debug for DriverConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DriverConfig")
            .field("host", &self.connect.get_host())
            .field("port", &self.connect.get_port())
            .field("database", &self.connect.get_database())
            .field("user", &self.connect.get_username())
            .field("connect_timeout", &self.connect_timeout)
            .field("heartbeat", &self.heartbeat)
            .field("statement_timeout", &self.statement_timeout)
            .finish_non_exhaustive()
    }
}

/// Starts a driver for a new shared connection and returns its inbox. The
/// connection is opened inside the task, so no caller ever awaits it while
/// holding anything; requests queue until it is up.
pub(super) fn spawn(config: DriverConfig, slot: usize) -> Inbox {
    let (inbox, requests) = mpsc::unbounded_channel();
    let span = tracing::debug_span!("distlock.mux.conn", slot, pid = tracing::field::Empty);
    let own = inbox.downgrade();
    tokio::spawn(tracing::Instrument::instrument(
        run(config, requests, own),
        span,
    ));
    inbox
}

async fn run(
    config: DriverConfig,
    mut requests: mpsc::UnboundedReceiver<Request>,
    own: mpsc::WeakUnboundedSender<Request>,
) {
    let (conn, pid) = match connect(&config).await {
        Ok(up) => up,
        Err(err) => {
            tracing::warn!(error = %err, "distlock multiplexed connection failed to open");
            return refuse_all(&mut requests, Some(err));
        }
    };
    tracing::Span::current().record("pid", pid);
    let (loss, _) = watch::channel(None);
    let driver = Driver {
        conn,
        pid,
        statement_timeout: config.statement_timeout,
        locks: HashMap::new(),
        by_key: HashMap::new(),
        by_server: HashMap::new(),
        next_id: 0,
        loss,
        own,
    };
    driver.serve(requests, config.heartbeat).await;
}

/// Opens the shared connection. Before any lock is taken on it, the
/// connection is probed for a transaction-pooling proxy, as in the default
/// mode (3 round trips, once per connection); the statement that then reads
/// the backend pid also sets the TCP keepalives, so the server ends the
/// session (freeing every lock on it) within about 25 s of a partition (idle
/// 10 s + 3 probes 5 s apart, or 30 s of unacknowledged data). They are set
/// by statement rather than in the startup packet, which PgBouncer rejects
/// ("unsupported startup parameter: options").
async fn connect(config: &DriverConfig) -> Result<(PgConnection, i32), Error> {
    let open = async {
        let mut conn = config.connect.connect().await.map_err(connect_error)?;
        PoolerCheck::default().ensure_session(&mut conn).await?;
        let pid: i32 = sqlx::query_scalar(FIRST_HEARTBEAT)
            .fetch_one(&mut conn)
            .await?;
        Ok::<_, Error>((conn, pid))
    };
    match timeout(config.connect_timeout, open).await {
        Ok(up) => up,
        Err(_) => Err(Error::Database(sqlx::Error::PoolTimedOut)),
    }
}

/// Answers every queued and future request of a driver that has no
/// connection: tries may retry elsewhere, unlocks have nothing to do (the
/// server freed the locks with the session).
fn refuse_all(requests: &mut mpsc::UnboundedReceiver<Request>, err: Option<Error>) {
    requests.close();
    let mut err = err;
    while let Ok(request) = requests.try_recv() {
        match request {
            Request::Try { reply, .. } => {
                let outcome = match err.take() {
                    // The first caller learns why; the others retry, and
                    // their retry reports its own failure. A connection
                    // limit refuses a retry as well: every caller learns it.
                    Some(first) => {
                        if let Error::TooManyConnections { message } = &first {
                            err = Some(Error::TooManyConnections {
                                message: message.clone(),
                            });
                        }
                        Err(TryError::Failed(first))
                    }
                    None => Err(TryError::Gone),
                };
                let _ = reply.send(outcome);
            }
            // Dropping the reply tells the releaser the lock is gone.
            Request::Unlock { .. } => {}
        }
    }
}

/// One lock held on the shared connection.
#[derive(Debug)]
struct Held {
    key: LockKey,
    server: ServerKey,
    since: std::time::Instant,
}

struct Driver {
    conn: PgConnection,
    pid: i32,
    statement_timeout: Duration,
    locks: HashMap<u64, Held>,
    /// Held locks by the caller's key: a second try of the same key on this
    /// connection is busy without a round trip.
    by_key: HashMap<LockKey, u64>,
    /// Held locks by the server's key: a different `LockKey` naming the same
    /// server lock is caught after the try (see `sql`).
    by_server: HashMap<ServerKey, u64>,
    next_id: u64,
    loss: watch::Sender<Option<LossReason>>,
    /// Given to tickets; weak so that the driver ends once the locker and
    /// every lock on this connection are gone.
    own: mpsc::WeakUnboundedSender<Request>,
}

impl Driver {
    async fn serve(mut self, mut requests: mpsc::UnboundedReceiver<Request>, every: Duration) {
        let mut next = crate::deadline::from_now(every);
        loop {
            // The heartbeat goes first when due, so a busy inbox cannot
            // starve it; between heartbeats each answered statement is proof
            // of life too (it carries the backend pid).
            let step = tokio::select! {
                biased;
                () = sleep_until(next) => {
                    next = crate::deadline::from_now(every);
                    if self.locks.is_empty() { Ok(()) } else { self.heartbeat().await }
                }
                request = requests.recv() => match request {
                    Some(request) => self.handle(request).await,
                    None => return self.close().await,
                },
            };
            if let Err(reason) = step {
                return self.lost(reason, &mut requests);
            }
        }
    }

    async fn handle(&mut self, request: Request) -> Result<(), LossReason> {
        match request {
            Request::Try {
                key,
                fencing,
                reply,
            } => self.try_lock(key, fencing, reply).await,
            Request::Unlock { id, reply } => self.unlock(id, reply).await,
        }
    }

    /// Tries `key` on the shared connection. A key this connection already
    /// holds is busy: PostgreSQL would grant it again to the same session.
    async fn try_lock(
        &mut self,
        key: LockKey,
        fencing: bool,
        reply: oneshot::Sender<TryOutcome>,
    ) -> Result<(), LossReason> {
        if reply.is_closed() {
            return Ok(()); // the caller went away before we started
        }
        let known = ServerKey::known(&key);
        if self.by_key.contains_key(&key) || known.is_some_and(|k| self.by_server.contains_key(&k))
        {
            let _ = reply.send(Ok(None));
            return Ok(());
        }
        let args = match key.args() {
            Ok(args) => args,
            Err(err) => {
                let _ = reply.send(Err(TryError::Failed(err)));
                return Ok(());
            }
        };
        let query = sql::try_lock(args, fencing, self.locks.len()).fetch_one(&mut self.conn);
        let row = match timeout(self.statement_timeout, query).await {
            Err(_) => {
                let _ = reply.send(Err(TryError::Gone));
                return Err(LossReason::HeartbeatTimedOut(self.statement_timeout));
            }
            Ok(Err(err)) if fatal(&err) => {
                let _ = reply.send(Err(TryError::Gone));
                return Err(LossReason::ConnectionFailed(err.to_string()));
            }
            // A prepared statement another client made on this session, or
            // one of ours gone: a transaction pooler shares the session, so
            // none of its locks can be trusted (as in the default mode).
            Ok(Err(err)) if shared_session(&err) => {
                let refused = Error::PoolerDetected {
                    expected_pid: self.pid,
                    actual_pid: 0,
                };
                let _ = reply.send(Err(TryError::Failed(refused)));
                return Err(LossReason::SessionShared(err.to_string()));
            }
            // A full lock table is raised by the lock function itself, so an
            // unfenced try that hit it took nothing; the session stays.
            Ok(Err(err)) if !fencing && is_lock_table_full(&err) => {
                let _ = reply.send(Err(TryError::Failed(locking_error(err, &key))));
                return Ok(());
            }
            // Any other error may come after the grant (the token write
            // timing out, a statement_timeout): session advisory locks
            // survive the error of the statement that took them, so the
            // session may now hold a lock no guard owns. Closing it is the
            // one sure way to free it.
            Ok(Err(err)) => {
                let reason = LossReason::SessionAbandoned(err.to_string());
                let _ = reply.send(Err(TryError::Failed(locking_error(err, &key))));
                return Err(reason);
            }
            Ok(Ok(row)) => row,
        };
        let row = match sql::decode_try(&row, args, fencing) {
            Ok(row) => row,
            Err(err) => {
                // We cannot tell what the statement did: give the session up.
                let _ = reply.send(Err(TryError::Gone));
                return Err(LossReason::ConnectionFailed(err.to_string()));
            }
        };
        if row.pid != self.pid {
            let _ = reply.send(Err(TryError::Failed(Error::PoolerDetected {
                expected_pid: self.pid,
                actual_pid: row.pid,
            })));
            return Err(LossReason::BackendChanged {
                expected_pid: self.pid,
                actual_pid: row.pid,
            });
        }
        let Some(locked) = row.locked else {
            // The session holds locks this driver did not take: another
            // client shares it (a transaction pooler). Nothing was taken.
            let _ = reply.send(Err(TryError::Failed(Error::PoolerDetected {
                expected_pid: self.pid,
                actual_pid: row.pid,
            })));
            return Err(LossReason::SessionShared(
                "the session holds advisory locks this connection did not take".into(),
            ));
        };
        if !locked {
            let _ = reply.send(Ok(None));
            return Ok(());
        }
        if self.by_server.contains_key(&row.key) {
            // Re-entrant grant of a lock this session already holds under
            // another name: take the extra level back and report busy.
            let _ = reply.send(Ok(None));
            let held = self.locks.len();
            return self.unlock_level(row.key, held).await.map(|_| ());
        }
        let id = self.next_id;
        self.next_id += 1;
        self.locks.insert(
            id,
            Held {
                key: key.clone(),
                server: row.key,
                since: std::time::Instant::now(),
            },
        );
        self.by_key.insert(key, id);
        self.by_server.insert(row.key, id);
        let Some(inbox) = self.own.upgrade() else {
            // Unreachable while we serve requests (a request came through an
            // inbox), but never hand out a lock nobody can release.
            return self.unlock(id, None).await;
        };
        let granted = Granted {
            ticket: Ticket::new(id, inbox),
            pid: self.pid,
            token: row.token,
            loss: self.loss.subscribe(),
        };
        // If the caller is gone, the grant comes back and dropping its
        // ticket queues the unlock behind this request.
        drop(reply.send(Ok(Some(granted))));
        Ok(())
    }

    async fn unlock(
        &mut self,
        id: u64,
        reply: Option<oneshot::Sender<Result<(), Error>>>,
    ) -> Result<(), LossReason> {
        let Some(held) = self.locks.remove(&id) else {
            return Ok(());
        };
        self.by_key.remove(&held.key);
        self.by_server.remove(&held.server);
        let outcome = self.unlock_level(held.server, self.locks.len()).await;
        let (result, step) = match outcome {
            Ok(true) => {
                crate::metrics::released("postgres", &held.key, held.since.elapsed());
                (Ok(()), Ok(()))
            }
            Ok(false) => {
                tracing::warn!(key = %held.key, "distlock multiplexed lock was not held at release");
                let err = Error::LockNotHeld {
                    key: held.key.to_string(),
                };
                (Err(err), Ok(()))
            }
            Err(reason) => {
                let err = match &reason {
                    LossReason::BackendChanged {
                        expected_pid,
                        actual_pid,
                    } => Error::PoolerDetected {
                        expected_pid: *expected_pid,
                        actual_pid: *actual_pid,
                    },
                    LossReason::HeartbeatTimedOut(after) => Error::ReleaseTimedOut {
                        key: held.key.to_string(),
                        after: *after,
                    },
                    _ => Error::LockLost {
                        key: held.key.to_string(),
                        reason: reason.clone(),
                    },
                };
                (Err(err), Err(reason))
            }
        };
        match reply {
            Some(reply) => drop(reply.send(result)),
            None => {
                if let Err(err) = result {
                    tracing::warn!(key = %held.key, error = %err, "background release of a dropped multiplexed lock failed");
                } else {
                    tracing::debug!(key = %held.key, "distlock multiplexed lock released");
                }
            }
        }
        step
    }

    /// Runs one `pg_advisory_unlock`; any failure leaves the lock's state on
    /// the session unknown, so it costs the whole connection (closing it is
    /// what frees the lock for sure).
    async fn unlock_level(&mut self, key: ServerKey, held: usize) -> Result<bool, LossReason> {
        let query = sql::unlock(key, held).fetch_one(&mut self.conn);
        let row = match timeout(self.statement_timeout, query).await {
            Err(_) => return Err(LossReason::HeartbeatTimedOut(self.statement_timeout)),
            Ok(Err(err)) => return Err(loss_reason(&err)),
            Ok(Ok(row)) => row,
        };
        let decoded = sqlx::Row::try_get::<bool, _>(&row, 0)
            .and_then(|unlocked| Ok((unlocked, sqlx::Row::try_get::<i32, _>(&row, 1)?)));
        match decoded {
            Err(err) => Err(LossReason::ConnectionFailed(err.to_string())),
            Ok((_, pid)) if pid != self.pid => Err(LossReason::BackendChanged {
                expected_pid: self.pid,
                actual_pid: pid,
            }),
            Ok((unlocked, _)) => Ok(unlocked),
        }
    }

    /// The same backend must still answer, within the deadline.
    async fn heartbeat(&mut self) -> Result<(), LossReason> {
        let query =
            sqlx::query_as::<_, (i32, Option<String>)>(sql::HEARTBEAT).fetch_one(&mut self.conn);
        let expected = self.locks.len().to_string();
        match timeout(self.statement_timeout, query).await {
            Err(_) => Err(LossReason::HeartbeatTimedOut(self.statement_timeout)),
            Ok(Err(err)) => Err(loss_reason(&err)),
            Ok(Ok((pid, _))) if pid != self.pid => Err(LossReason::BackendChanged {
                expected_pid: self.pid,
                actual_pid: pid,
            }),
            Ok(Ok((_, marker))) if marker.as_deref() != Some(expected.as_str()) => {
                Err(LossReason::SessionShared(format!(
                    "the session's lock count is {marker:?}, this connection holds {expected}"
                )))
            }
            Ok(Ok(_)) => Ok(()),
        }
    }

    /// Every lock on this connection is lost at once: publish the reason to
    /// all their guards with one send, drop the socket (the server frees the
    /// locks when the session ends) and turn away what is still queued.
    fn lost(self, reason: LossReason, requests: &mut mpsc::UnboundedReceiver<Request>) {
        tracing::warn!(
            %reason,
            locks = self.locks.len(),
            "distlock multiplexed connection lost; all its locks are lost"
        );
        for held in self.locks.values() {
            crate::metrics::lost("postgres", &held.key);
        }
        self.loss.send_replace(Some(reason));
        // Dropping a `PgConnection` without `close` drops the socket without
        // a goodbye, like `HeldConn` does for a lock's connection.
        drop(self.conn);
        refuse_all(requests, None);
    }

    /// Nobody can send anything any more: no lock is held, say goodbye.
    async fn close(self) {
        let _ = timeout(self.statement_timeout, self.conn.close()).await;
    }
}

/// Whether a failed statement is PostgreSQL's "out of shared memory" (the
/// lock table is full).
fn is_lock_table_full(err: &sqlx::Error) -> bool {
    sqlstate(err).as_deref() == Some(crate::postgres::sqlstate::OUT_OF_SHARED_MEMORY)
}

/// Whether a failed statement means the session is gone or unusable, rather
/// than a statement error on a healthy session.
fn fatal(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Database(_) => {
            // Class 08 (connection exception) and 57P (shutdown, as
            // `pg_terminate_backend` sends; idle timeouts) end the session.
            // 57014, a cancelled statement, does not.
            let code = sqlstate(err).unwrap_or_default();
            code.starts_with("08") || code.starts_with("57P")
        }
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_the_password() {
        let connect = PgConnectOptions::new()
            .host("db.example")
            .username("app")
            .password("s3cret-Pa55");
        let config = DriverConfig {
            connect,
            connect_timeout: Duration::from_secs(1),
            heartbeat: Duration::from_secs(1),
            statement_timeout: Duration::from_secs(1),
        };
        let shown = format!("{config:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("db.example"), "{shown}");
    }
}
