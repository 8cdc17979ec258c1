//! The lease table's record of who leads an election (`ElectionLocker`):
//! a row of `distlock.leaders` (via 2) naming the lease's owner, believed
//! only while the lease row is that owner's and unexpired by the server's
//! clock. Statements are simple queries, as every statement of the lease
//! table, so they work through a transaction pooler.

use std::time::Duration;

use async_trait::async_trait;
use sqlx::AssertSqlSafe;
use sqlx::postgres::PgRow;

use super::TableLocker;
use super::sql::{self, KeyExpr, Owner};
use crate::capability::{WITHDRAW_WITHIN, recorded_term};
use crate::postgres::election::{leader_info, proclaimed};
use crate::postgres::sqlstate::lock_not_available;
use crate::postgres::timeout::answered_on_pool;
use crate::{ElectionLocker, Error, LeaderInfo, Lease, LockKey, Proclaimed, Proclamation, Seat};

impl TableLocker {
    /// Runs one simple-query statement for `key`, built by `sql` from how
    /// long it may wait; its rows. Answered within `within` (at most the
    /// renewal deadline) or [`Error::CommandTimedOut`] (a campaign holding
    /// the election's lease must not wait on a stalled network until TCP
    /// gives up); only a connection that answered goes back to the pool.
    /// A statement that waits for a locked row waits as long on the server
    /// (see `sql::after_lock_timeout`), so it does not stay behind once
    /// given up; the server's timeout, should it come first, is the same
    /// error.
    async fn simple(
        &self,
        (key, within): (&LockKey, Duration),
        sql: impl FnOnce(Duration) -> String,
    ) -> Result<Vec<PgRow>, Error> {
        let within = within.min(self.inner.renewal_deadline());
        let sql = sql(within);
        let rows = answered_on_pool(self.pool(), (key, within), async |conn| {
            Ok(sqlx::raw_sql(AssertSqlSafe(sql)).fetch_all(conn).await?)
        })
        .await;
        match rows {
            Err(Error::Database(err)) if lock_not_available(&err) => Err(Error::CommandTimedOut {
                key: key.clone(),
                after: within,
            }),
            rows => rows,
        }
    }
}

/// Each call is 1 round trip, one short transaction, answered within the
/// renewal deadline (two thirds of the TTL; a withdrawal within 5 s at
/// most, as long as a campaign waits for it) or
/// [`Error::CommandTimedOut`]; a seat is the lease's owner.
#[async_trait]
impl ElectionLocker for TableLocker {
    async fn lock_seat(
        &self,
        key: LockKey,
        timeout: Duration,
    ) -> Result<(Box<dyn Lease>, Seat), Error> {
        let lease = TableLocker::lock(self, key, timeout).await?;
        let seat = Seat::new(lease.owner().bits());
        Ok((Box::new(lease), seat))
    }

    async fn proclaim(
        &self,
        key: &LockKey,
        seat: Seat,
        proclamation: &Proclamation,
    ) -> Result<Option<Proclaimed>, Error> {
        key.validate()?;
        proclamation.check()?;
        let owner = Owner::from_bits(seat.id());
        let (expr, key_text) = (KeyExpr::new(key), key.to_string());
        let statement = |wait| sql::proclaim(&expr, owner, proclamation, (&key_text, wait));
        let rows = self.simple((key, Duration::MAX), statement).await?;
        match rows.first() {
            Some(row) => proclaimed(row, proclamation),
            None => Ok(None),
        }
    }

    async fn withdraw(&self, key: &LockKey, seat: Seat, number: Option<u64>) -> Result<(), Error> {
        key.validate()?;
        let Some(number) = recorded_term(number) else {
            return Ok(());
        };
        let owner = Owner::from_bits(seat.id());
        let expr = KeyExpr::new(key);
        let within = (key, WITHDRAW_WITHIN);
        self.simple(within, |wait| sql::withdraw(&expr, owner, number, wait))
            .await?;
        Ok(())
    }

    async fn leader(&self, key: &LockKey) -> Result<Option<LeaderInfo>, Error> {
        key.validate()?;
        let statement = |_| sql::leader_of(&KeyExpr::new(key));
        let rows = self.simple((key, Duration::MAX), statement).await?;
        rows.first().map(leader_info).transpose()
    }

    fn loss_notice_bound(&self) -> Duration {
        // A holder that cannot renew reports its loss a third of a TTL
        // before its lease expires, and deletes its own row only when the
        // lease would have expired anyway (`Renewal::lose` in `renew.rs`):
        // a successor's grant comes at least a third of a TTL after the
        // report, by which time the deposed leader's term has ended (when
        // its task next ran); no grace is added.
        Duration::ZERO
    }
}
