//! The task that owns one shared connection: it runs every lock and unlock
//! statement for the locks pinned to it, one heartbeat per interval for all
//! of them, and declares them all lost at once when the connection fails or
//! an unlock finds that the session no longer held its lock.
//!
//! Between statements the task keeps reading the connection's socket, so
//! when the server ends the session (`pg_terminate_backend`, a fast
//! shutdown, a crash, a switchover: an ErrorResponse, then the socket
//! closes) the locks are declared lost at once, not at the next heartbeat.
//! The heartbeat stays for the failures nobody announces (a partition, a
//! stalled server). The reading is sqlx's `PgListener`, which reads its
//! connection between statements and runs them too; it is never given a
//! channel, and it cannot reconnect (see [`connect`]).

use std::collections::HashMap;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use sqlx::{Acquire, ConnectOptions, Connection};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::{sleep_until, timeout};

use super::place::Place;
use super::refusal::{answer, refuse_all};
use super::request::{Granted, Inbox, Request, Ticket, TryError, TryOutcome};
use super::sql::{self, ServerKey};
use crate::postgres::conn::watched::close_listener;
use crate::postgres::pooler::{
    PoolerCheck, backend_changed, loss_reason, marker_seen, shared_session, shared_session_error,
};
use crate::postgres::request::key_args::KeyArgs;
use crate::postgres::session::heartbeat::FIRST_HEARTBEAT;
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
///
/// The connection comes from a private pool of one, which a `PgListener`
/// needs; the pool is closed as soon as the connection is out, so the
/// listener can never open another session behind the locks' back (a lost
/// connection stays lost), and a listener dropped with its connection hands
/// it to a closed pool, which closes it: the session ends and frees its
/// locks.
async fn connect(config: &DriverConfig) -> Result<(PgListener, i32), Error> {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .max_lifetime(None)
        .idle_timeout(None)
        .test_before_acquire(false)
        .acquire_timeout(config.connect_timeout)
        .connect_lazy_with(config.connect.clone());
    let listener = PgListener::connect_with(&pool).await;
    // Marks the pool closed at once; nothing waits for it.
    drop(pool.close());
    let mut listener = match listener {
        Ok(listener) => listener,
        // The pool retries a refusal it takes for a passing one (a
        // connection limit, a server starting up) until its deadline, and
        // then only says that it timed out: one direct attempt tells why.
        Err(sqlx::Error::PoolTimedOut) => return Err(why_not(config).await),
        Err(err) => return Err(connect_error(err)),
    };
    let open = async {
        // Closing the private pool is not a reason to stop reading.
        listener.ignore_pool_close_event(true);
        // A lost connection must not be replaced (the pool refuses anyway).
        listener.eager_reconnect(false);
        let conn = (&mut listener).acquire().await?;
        PoolerCheck::default().ensure_session(conn).await?;
        // The connection's first named statement: a server session that a
        // transaction pooler shares has another client's under that name
        // (42P05) while its backend stays the same, so the probe saw
        // nothing; as on every session path, that is a pooler.
        let pid: i32 = sqlx::query_scalar(FIRST_HEARTBEAT)
            .fetch_one(&mut *conn)
            .await
            .map_err(|err| {
                if shared_session(&err) {
                    shared_session_error(&err)
                } else {
                    Error::from(err)
                }
            })?;
        Ok::<_, Error>((listener, pid))
    };
    match timeout(config.connect_timeout, open).await {
        Ok(up) => up,
        Err(_) => Err(Error::ConnectTimedOut {
            after: config.connect_timeout,
        }),
    }
}

/// Why the shared connection could not be opened, from one direct attempt
/// (within the connect deadline) after the private pool gave up.
async fn why_not(config: &DriverConfig) -> Error {
    match timeout(config.connect_timeout, config.connect.connect()).await {
        Ok(Err(err)) => connect_error(err),
        // It worked this time: the refusal has passed; report the timeout.
        Ok(Ok(conn)) => {
            let _ = timeout(config.connect_timeout, conn.close()).await;
            Error::ConnectTimedOut {
                after: config.connect_timeout,
            }
        }
        Err(_) => Error::ConnectTimedOut {
            after: config.connect_timeout,
        },
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
    /// The shared connection; reading it between statements is what tells
    /// of a server-ended session at once.
    conn: PgListener,
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
                    None => return self.close(),
                },
                // Cancel safe: sqlx consumes a message only once it is read
                // whole. Nothing is ever listened to, so all that can come
                // while no statement runs is the server's goodbye.
                goodbye = self.conn.try_recv() => match goodbye {
                    Ok(Some(_)) => Ok(()),
                    Ok(None) => Err(LossReason::ConnectionFailed(
                        "the server ended the session (the connection closed)".into(),
                    )),
                    Err(err) => Err(loss_reason(&err)),
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
                place,
            } => self.try_lock(key, fencing, reply, place).await,
            Request::Unlock { id, reply, place } => self.unlock(id, reply, place).await,
        }
    }

    /// Tries `key` on the shared connection. A key this connection already
    /// holds is busy: PostgreSQL would grant it again to the same session.
    async fn try_lock(
        &mut self,
        key: LockKey,
        fencing: bool,
        reply: oneshot::Sender<TryOutcome>,
        place: Place,
    ) -> Result<(), LossReason> {
        if reply.is_closed() {
            return Ok(()); // the caller went away before we started
        }
        let known = ServerKey::known(&key);
        if self.by_key.contains_key(&key) || known.is_some_and(|k| self.by_server.contains_key(&k))
        {
            answer(reply, place, Ok(None));
            return Ok(());
        }
        let args = match key.args() {
            Ok(args) => args,
            Err(err) => {
                answer(reply, place, Err(TryError::Failed(err)));
                return Ok(());
            }
        };
        let query = sql::try_lock(args, fencing, self.locks.len()).fetch_one(&mut self.conn);
        let row = match timeout(self.statement_timeout, query).await {
            Err(_) => {
                answer(reply, place, Err(TryError::Gone));
                return Err(LossReason::HeartbeatTimedOut(self.statement_timeout));
            }
            Ok(Err(err)) if fatal(&err) => {
                answer(reply, place, Err(TryError::Gone));
                return Err(LossReason::ConnectionFailed(err.to_string()));
            }
            // A prepared statement another client made on this session, or
            // one of ours gone: a transaction pooler shares the session, so
            // none of its locks can be trusted (as in the default mode).
            Ok(Err(err)) if shared_session(&err) => {
                let refused = shared_session_error(&err);
                answer(reply, place, Err(TryError::Failed(refused)));
                return Err(LossReason::SessionShared(err.to_string()));
            }
            // Any other error may come after the grant (the token write
            // timing out, a statement_timeout): session advisory locks
            // survive the error of the statement that took them, so the
            // session may now hold a lock no guard owns, which closing it
            // is the one sure way to free. Unless it provably took nothing
            // (a full lock table, raised by the lock function itself): then
            // the session, and every other lock on it, stays.
            Ok(Err(err)) => {
                let reason = LossReason::SessionAbandoned(err.to_string());
                let stays = self.took_nothing(args).await;
                answer(
                    reply,
                    place,
                    Err(TryError::Failed(locking_error(err, &key))),
                );
                return if stays { Ok(()) } else { Err(reason) };
            }
            Ok(Ok(row)) => row,
        };
        let row = match sql::decode_try(&row, (&key, args), fencing) {
            Ok(row) => row,
            // A grant without its token: the lock may be held with no guard
            // to own it, so the session goes, which frees it.
            Err(err @ Error::MissingFencingToken { .. }) => {
                let reason = LossReason::SessionAbandoned(err.to_string());
                answer(reply, place, Err(TryError::Failed(err)));
                return Err(reason);
            }
            Err(err) => {
                // We cannot tell what the statement did: give the session up.
                answer(reply, place, Err(TryError::Gone));
                return Err(LossReason::ConnectionFailed(err.to_string()));
            }
        };
        if row.pid != self.pid {
            answer(
                reply,
                place,
                Err(TryError::Failed(backend_changed(self.pid, row.pid))),
            );
            return Err(LossReason::BackendChanged {
                expected_pid: self.pid,
                actual_pid: row.pid,
            });
        }
        let Some(locked) = row.locked else {
            // The session holds locks this driver did not take: another
            // client shares it (a transaction pooler). Nothing was taken.
            answer(reply, place, Err(TryError::Failed(marker_seen(row.pid))));
            return Err(LossReason::SessionShared(
                "the session holds advisory locks this connection did not take".into(),
            ));
        };
        if !locked {
            answer(reply, place, Ok(None));
            return Ok(());
        }
        if self.by_server.contains_key(&row.key) {
            // Re-entrant grant of a lock this session already holds under
            // another name: take the extra level back and report busy.
            answer(reply, place, Ok(None));
            let held = self.locks.len();
            // The try just added a level, so there is one to take back; a
            // `false` means the session's locks were released under us.
            if self.unlock_level(row.key, held).await? {
                return Ok(());
            }
            return Err(released_elsewhere(row.key));
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
            return self.unlock(id, None, Some(place)).await;
        };
        let mut ticket = Ticket::new(id, inbox);
        ticket.keep(place);
        let granted = Granted {
            ticket,
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
        place: Option<Place>,
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
            // This guard learns what its own release found; the other
            // locks of the session are in doubt and go with the connection.
            Ok(false) => {
                tracing::warn!(key = %held.key, "distlock multiplexed lock was not held at release");
                let err = Error::LockLost {
                    key: held.key.clone(),
                    reason: LossReason::NotHeld,
                };
                (Err(err), Err(released_elsewhere(held.server)))
            }
            Err(reason) => {
                // A changed backend is a lost lock here, as in the default
                // mode's release (it went with the backend that took it).
                let err = match &reason {
                    LossReason::HeartbeatTimedOut(after) => Error::ReleaseTimedOut {
                        key: held.key.clone(),
                        after: *after,
                    },
                    _ => Error::LockLost {
                        key: held.key.clone(),
                        reason: reason.clone(),
                    },
                };
                (Err(err), Err(reason))
            }
        };
        // The lock is gone (or its connection goes with it, on an error):
        // its place under `max_locks` is free before its releaser learns
        // so, which may take another lock at once.
        drop(place);
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

    /// Whether the try of `args` that just failed took nothing: the session
    /// holds exactly the driver's locks (each a server lock of its own, so
    /// one row apiece in `pg_locks`), and the try's key is none of them (a
    /// re-entry would add no row). An unanswered lookup proves nothing.
    async fn took_nothing(&mut self, args: KeyArgs<'_>) -> bool {
        let query = sql::held_after(args).fetch_one(&mut self.conn);
        let Ok(Ok(row)) = timeout(self.statement_timeout, query).await else {
            return false;
        };
        let Ok(after) = sql::decode_held_after(&row) else {
            return false;
        };
        after.pid == self.pid
            && usize::try_from(after.held).is_ok_and(|held| held == self.locks.len())
            && after
                .key
                .is_some_and(|key| !self.by_server.contains_key(&key))
    }

    /// Runs one `pg_advisory_unlock`; any failure leaves the lock's state on
    /// the session unknown, so it costs the whole connection (closing it is
    /// what frees the lock for sure). An answer of `false` is the caller's
    /// to judge (see [`released_elsewhere`]). 1 round trip.
    async fn unlock_level(&mut self, key: ServerKey, held: usize) -> Result<bool, LossReason> {
        let query = sql::unlock(key, self.pid, held).fetch_one(&mut self.conn);
        let row = match timeout(self.statement_timeout, query).await {
            Err(_) => return Err(LossReason::HeartbeatTimedOut(self.statement_timeout)),
            Ok(Err(err)) => return Err(loss_reason(&err)),
            Ok(Ok(row)) => row,
        };
        let decoded = sqlx::Row::try_get::<Option<bool>, _>(&row, 0)
            .and_then(|unlocked| Ok((unlocked, sqlx::Row::try_get::<i32, _>(&row, 1)?)));
        match decoded {
            Err(err) => Err(LossReason::ConnectionFailed(err.to_string())),
            Ok((_, pid)) if pid != self.pid => Err(LossReason::BackendChanged {
                expected_pid: self.pid,
                actual_pid: pid,
            }),
            // The driver's backend, but its marker does not count the
            // driver's locks: another client's locks share the session.
            Ok((None, _)) => Err(LossReason::SessionShared(format!(
                "the session's lock count is not {}, the locks this connection held",
                held + 1
            ))),
            Ok((Some(unlocked), _)) => Ok(unlocked),
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
        // The socket is dropped (never a statement more, which a stalled
        // network would leave waiting forever): the session ends and frees
        // whatever it held. It never goes back to any pool.
        close_listener(self.conn);
        refuse_all(requests, None);
    }

    /// Nobody can send anything any more: no lock is held. The connection is
    /// closed by dropping its socket (see [`Driver::lost`]).
    fn close(self) {
        close_listener(self.conn);
    }
}

/// Why a connection is given up when one of its unlocks answered `false`.
/// The driver takes each server lock once and knows every lock its session
/// holds, so on its own session only something outside the driver can have
/// released it: another client sharing the session through a transaction
/// pooler (`pg_advisory_unlock_all()`, say), which the heartbeat cannot see
/// when it leaves the session marker alone, and the unlock statement has just
/// rewritten the marker to this driver's count anyway. Every other lock on
/// the session is then in doubt, so all are declared lost and the
/// connection is dropped.
fn released_elsewhere(key: ServerKey) -> LossReason {
    LossReason::SessionShared(format!(
        "the session no longer held the advisory lock {key:?} at its unlock: \
         something outside this connection released locks on it"
    ))
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
