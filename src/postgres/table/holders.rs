//! Who holds leases of the table: [`TableLocker::holders`].

use std::time::{Duration, SystemTime};

use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, Row};

use super::locker::TableLocker;
use super::sql::{self, KeyExpr};
use crate::{Error, FencingToken};

/// One live lease of `distlock.leases`, from [`TableLocker::holders`].
///
/// The table knows holders only: a waiter of the lease table retries (on a
/// notification or its poll interval) and leaves no trace there, so there is
/// no wait chain to show. Nor does it name a session or a process; the
/// lease's owner is a secret of its holder and is not shown.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeaseHolder {
    /// The key as its holder spelled it (`LockKey`'s display: the name, or
    /// the id in decimal).
    pub key: String,
    /// The fencing token the lease was granted with.
    pub fencing_token: FencingToken,
    /// When the lease was granted, by the server's clock.
    pub since: SystemTime,
    /// When its holder last renewed it.
    pub renewed: SystemTime,
    /// When it expires unless renewed again.
    pub expires: SystemTime,
}

impl TableLocker {
    /// The leases held right now (not expired by the server's clock), by
    /// key space and key. Expired rows that no grant has purged yet are left
    /// out: their keys are free.
    ///
    /// Costs 1 round trip, a read; one simple query, so it works through a
    /// transaction pooler. Answered within 5 s, or the renewal deadline
    /// (two thirds of the TTL) when that is longer, once the pool has
    /// handed out a connection (within its `acquire_timeout`): a stalled
    /// network fails it with [`Error::NoReply`] and closes its connection
    /// instead of hanging the caller. Needs [`migrate`](crate::migrate)
    /// ([`Error::NotMigrated`] otherwise).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a read on a pooled connection.
    pub async fn holders(&self) -> Result<Vec<LeaseHolder>, Error> {
        let rows = self
            .read_leases("TableLocker::holders", sql::LIVE_LEASES.to_owned())
            .await?;
        rows.iter().map(decode).collect()
    }

    /// The live lease of `key`, if one is held: the lease a
    /// [`try_lock`](Self::try_lock) of `key` would find (by the key's
    /// server-side identity, so a lease of another name whose hash collides
    /// with this one's is it, spelled as its holder spelled it; a
    /// [`LockKey::id`](crate::LockKey::id) and a name that reads the same
    /// are different leases). A bad key is refused before any round trip.
    /// Otherwise as [`holders`](Self::holders): 1 round trip, a read, one
    /// simple query, answered within the same deadline.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a read on a pooled connection.
    pub async fn holder_of(
        &self,
        key: impl Into<crate::LockKey>,
    ) -> Result<Option<LeaseHolder>, Error> {
        let key = key.into();
        key.validate()?;
        let statement = sql::live_lease_of(&KeyExpr::new(&key));
        let rows = self
            .read_leases("TableLocker::holder_of", statement)
            .await?;
        rows.first().map(decode).transpose()
    }

    /// The rows `statement` (a simple query) answers, on a pooled
    /// connection, within 5 s or the renewal deadline when that is longer
    /// ([`Error::NoReply`] naming `call`).
    async fn read_leases(
        &self,
        call: &'static str,
        statement: String,
    ) -> Result<Vec<PgRow>, Error> {
        let within = self
            .inner
            .renewal_deadline()
            .max(crate::postgres::holders::READ_WITHIN);
        let read = async |conn: &mut sqlx::PgConnection| {
            Ok(sqlx::raw_sql(AssertSqlSafe(statement))
                .fetch_all(conn)
                .await?)
        };
        Box::pin(crate::postgres::timeout::read_on_pool(
            self.pool(),
            (call, within),
            read,
        ))
        .await
    }
}

fn decode(row: &PgRow) -> Result<LeaseHolder, Error> {
    let at = |column: usize| -> Result<SystemTime, Error> {
        let micros: i64 = row.try_get(column)?;
        let since_epoch = Duration::from_micros(micros.unsigned_abs());
        Ok(if micros < 0 {
            SystemTime::UNIX_EPOCH - since_epoch
        } else {
            SystemTime::UNIX_EPOCH + since_epoch
        })
    };
    Ok(LeaseHolder {
        key: row.try_get(0)?,
        fencing_token: FencingToken::new(row.try_get(1)?),
        since: at(2)?,
        renewed: at(3)?,
        expires: at(4)?,
    })
}
