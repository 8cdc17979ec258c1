//! `PgLocker`'s record of who leads an election (`ElectionLocker`): a row
//! of `distlock.leaders` per election, written by the leader and believed
//! only while `pg_locks` shows the backend it names holding the lock.
//!
//! The rule lives in the schema's functions (`distlock.leader_proclaim`,
//! `leader_withdraw`, `leader_of`, migration `leader_records`), so SQL of
//! any language can ask who leads by it; here each is one statement.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Postgres, Row};

use crate::capability::{WITHDRAW_WITHIN, recorded_term};
use crate::postgres::request::fragments::millis_setting;
use crate::postgres::request::key::Bound;
use crate::postgres::request::sql::{ELECTION_KEY, ELECTION_KEY_WRITING};
use crate::postgres::sqlstate::lock_not_available;
use crate::postgres::timeout::answered_on_pool;
use crate::{
    ElectionLocker, Error, FencingToken, LeaderInfo, Lease, LockKey, PgLocker, Proclaimed,
    Proclamation, Seat,
};

// Via 1: records of session advisory locks. The statements that write
// the record follow `ELECTION_KEY_WRITING` (`$4` the `lock_timeout`).

const PROCLAIM: &str = "SELECT p.term, \
     (extract(epoch FROM p.since) OPERATOR(pg_catalog.*) 1000000)::pg_catalog.int8, p.after_loss \
     FROM e, distlock.leader_proclaim(1::pg_catalog.int2, e.space, e.lock_id, $5, $6, NULL, \
     $7, $8, $9, $10) AS p";

const WITHDRAW: &str =
    "SELECT distlock.leader_withdraw(1::pg_catalog.int2, e.space, e.lock_id, $5, NULL, $6) FROM e";

const LEADER: &str = "SELECT l.identity, l.value, l.term, \
     (extract(epoch FROM l.since) OPERATOR(pg_catalog.*) 1000000)::pg_catalog.int8, l.fencing_token \
     FROM e, distlock.leader_of(1::pg_catalog.int2, e.space, e.lock_id) AS l";

/// `sql` after [`ELECTION_KEY`], with the key's three parameters bound
/// in the request core's one key shape.
fn keyed<'q>(
    sql: &'static str,
    key: &'q LockKey,
) -> Result<sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>, Error> {
    let text: String = [ELECTION_KEY, sql].concat();
    Ok(Bound::from(key.args()?).bind(sqlx::query(sqlx::AssertSqlSafe(text))))
}

/// `sql` after [`ELECTION_KEY_WRITING`], with the key's three parameters
/// and then the `lock_timeout` of `wait` bound: the statement waits for
/// the record's row (locked by another transaction) at most `wait`.
fn keyed_writing<'q>(
    sql: &'static str,
    key: &'q LockKey,
    wait: Duration,
) -> Result<sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>, Error> {
    let text: String = [ELECTION_KEY_WRITING, sql].concat();
    let query = Bound::from(key.args()?).bind(sqlx::query(sqlx::AssertSqlSafe(text)));
    Ok(query.bind(millis_setting(wait)))
}

/// The backend pid a seat names.
fn pid(seat: Seat) -> Result<i32, Error> {
    i32::try_from(seat.id()).map_err(|_| Error::InvalidArgument {
        argument: "seat",
        reason: format!("{} is not a PostgreSQL backend pid", seat.id()),
    })
}

/// A server timestamp in microseconds since the Unix epoch.
fn instant(micros: i64) -> SystemTime {
    let offset = Duration::from_micros(micros.unsigned_abs());
    if micros >= 0 {
        UNIX_EPOCH + offset
    } else {
        UNIX_EPOCH - offset
    }
}

/// A term number as the row holds it (never below 1).
fn term(number: i64) -> u64 {
    u64::try_from(number).unwrap_or(0)
}

/// The answer of a proclamation, `(term, since in µs, after_loss)`, as
/// both lease kinds' statements return it: all `NULL` when the seat did
/// not hold the lock and nothing was recorded.
pub(super) fn proclaimed(
    row: &PgRow,
    proclamation: &Proclamation,
) -> Result<Option<Proclaimed>, Error> {
    let (Some(number), Some(since), Some(after_loss)) = (
        row.try_get::<Option<i64>, _>(0)?,
        row.try_get::<Option<i64>, _>(1)?,
        row.try_get::<Option<bool>, _>(2)?,
    ) else {
        return Ok(None);
    };
    let leader = LeaderInfo::new(
        proclamation.identity.clone(),
        proclamation.value.clone(),
        term(number),
        instant(since),
        proclamation.fencing_token,
    );
    Ok(Some(Proclaimed { leader, after_loss }))
}

/// A leader record, `(identity, value, term, since in µs, fencing_token)`,
/// as both lease kinds' `leader_of` statements return it.
pub(super) fn leader_info(row: &PgRow) -> Result<LeaderInfo, Error> {
    Ok(LeaderInfo::new(
        row.try_get::<String, _>(0)?,
        row.try_get::<String, _>(1)?,
        term(row.try_get(2)?),
        instant(row.try_get(3)?),
        row.try_get::<Option<i64>, _>(4)?.map(FencingToken::new),
    ))
}

impl PgLocker {
    /// A record's one statement on a pooled connection, answered within
    /// `within` or [`Error::CommandTimedOut`], its connection closed: a
    /// campaign holding the election's lock must not wait on a stalled
    /// network until TCP gives up, nor an observer's abandoned reads keep
    /// pool slots. A statement that writes the record waits for its row
    /// as long on the server ([`keyed_writing`]); the server's timeout,
    /// should it come first, is the same error.
    async fn answered_record<T>(
        &self,
        (key, within): (&LockKey, Duration),
        statement: impl AsyncFnOnce(&mut PgConnection) -> Result<T, Error>,
    ) -> Result<T, Error> {
        match answered_on_pool(self.pool(), (key, within), statement).await {
            Err(Error::Database(err)) if lock_not_available(&err) => Err(Error::CommandTimedOut {
                key: key.clone(),
                after: within,
            }),
            answer => answer,
        }
    }
}

/// Each method's costs are on the trait; a seat is the backend pid of the
/// session that holds the lock (its own connection, or in the multiplexed
/// mode the shared one).
#[async_trait]
impl ElectionLocker for PgLocker {
    async fn lock_seat(
        &self,
        key: LockKey,
        timeout: Duration,
    ) -> Result<(Box<dyn Lease>, Seat), Error> {
        let lock = PgLocker::lock(self, key, timeout).await?;
        let seat = Seat::new(u128::from(lock.backend_pid().unsigned_abs()));
        Ok((Box::new(lock), seat))
    }

    async fn proclaim(
        &self,
        key: &LockKey,
        seat: Seat,
        proclamation: &Proclamation,
    ) -> Result<Option<Proclaimed>, Error> {
        proclamation.check()?;
        let within = self.heartbeat_timeout();
        let query = keyed_writing(PROCLAIM, key, within)?
            .bind(key.to_string())
            .bind(pid(seat)?)
            .bind(proclamation.identity.as_str())
            .bind(proclamation.value.as_str())
            .bind(proclamation.fencing_token.map(FencingToken::value))
            .bind(i64::try_from(proclamation.grace.as_millis()).unwrap_or(i64::MAX));
        let row: PgRow = self
            .answered_record((key, within), async |conn| {
                Ok(query.fetch_one(conn).await?)
            })
            .await?;
        proclaimed(&row, proclamation)
    }

    async fn withdraw(&self, key: &LockKey, seat: Seat, number: Option<u64>) -> Result<(), Error> {
        let Some(number) = recorded_term(number) else {
            return Ok(());
        };
        let within = self.heartbeat_timeout().min(WITHDRAW_WITHIN);
        let query = keyed_writing(WITHDRAW, key, within)?
            .bind(pid(seat)?)
            .bind(number);
        self.answered_record((key, within), async |conn| Ok(query.execute(conn).await?))
            .await?;
        Ok(())
    }

    async fn leader(&self, key: &LockKey) -> Result<Option<LeaderInfo>, Error> {
        let query = keyed(LEADER, key)?;
        let row = self
            .answered_record((key, self.heartbeat_timeout()), async |conn| {
                Ok(query.fetch_optional(conn).await?)
            })
            .await?;
        row.as_ref().map(leader_info).transpose()
    }

    fn loss_notice_bound(&self) -> Duration {
        // A heartbeat that finds the session gone fails at once; one that
        // gets no answer counts as loss at its deadline.
        self.heartbeat().saturating_add(self.heartbeat_timeout())
    }
}
