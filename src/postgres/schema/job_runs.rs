//! The per-window run record in `distlock.job_runs`.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::PgPool;

use crate::job::SingletonJobBuilder;
use crate::job::window::{Claim, Current, RECORD_WITHIN, RunRecord, WindowStart};
use crate::postgres::timeout::answered_on_pool;
use crate::{Error, LockKey};

/// The window is computed from the *server's* clock so that replicas with
/// skewed clocks still agree on it; windows are aligned to the Unix epoch
/// (a one-day window starts at midnight UTC). A CTE `w` of one row: the
/// server's time in microseconds since the epoch (`now_us`), the current
/// window's start (for `$2`-µs windows) in microseconds (`start_us`) and as
/// a timestamp (`start`).
macro_rules! current_window {
    () => {
        "WITH w AS ( \
           SELECT now_us, start_us, 'epoch'::pg_catalog.timestamptz OPERATOR(pg_catalog.+) (start_us OPERATOR(pg_catalog.*) '1 microsecond'::pg_catalog.interval) AS start \
           FROM (SELECT now_us, now_us OPERATOR(pg_catalog.-) (now_us OPERATOR(pg_catalog.%) $2) AS start_us \
             FROM (SELECT (extract(epoch FROM pg_catalog.clock_timestamp()) OPERATOR(pg_catalog.*) 1000000)::pg_catalog.int8 AS now_us) n) s \
         )"
    };
}

/// Records the current window unless it is recorded. One statement, one
/// round trip.
const CLAIM: &str = concat!(
    current_window!(),
    ", ins AS ( \
       INSERT INTO distlock.job_runs (job, window_start) SELECT $1, w.start FROM w \
       ON CONFLICT (job, window_start) DO NOTHING \
       RETURNING 1 \
     ) \
     SELECT w.start_us, EXISTS (SELECT 1 FROM ins) FROM w"
);

/// Whether the current window is recorded (a run started in it), and how
/// many microseconds of it are left (the length less the time since its
/// start: no sum that could overflow). Reads only; one round trip.
const CURRENT: &str = concat!(
    current_window!(),
    " SELECT EXISTS (SELECT 1 FROM distlock.job_runs r \
         WHERE r.job OPERATOR(pg_catalog.=) $1 AND r.window_start OPERATOR(pg_catalog.=) w.start), \
       $2 OPERATOR(pg_catalog.-) (w.now_us OPERATOR(pg_catalog.-) w.start_us) \
     FROM w"
);

const FINISH: &str = "UPDATE distlock.job_runs SET finished_at = pg_catalog.now(), outcome = $3 \
     WHERE job OPERATOR(pg_catalog.=) $1 AND window_start OPERATOR(pg_catalog.=) ('epoch'::pg_catalog.timestamptz \
       OPERATOR(pg_catalog.+) ($2 OPERATOR(pg_catalog.*) '1 microsecond'::pg_catalog.interval))";

/// The run record in `distlock.job_runs`, on `pool`.
#[derive(Debug)]
struct JobRuns(PgPool);

#[async_trait]
impl RunRecord for JobRuns {
    /// 1 round trip, one durable write when the window is new.
    async fn claim(&self, key: &LockKey, job: &str, length_us: i64) -> Result<Claim, Error> {
        let query = sqlx::query_as(CLAIM).bind(job).bind(length_us);
        let (start, claimed): (i64, bool) =
            answered_on_pool(&self.0, (key, RECORD_WITHIN), async |conn| {
                Ok(query.fetch_one(conn).await?)
            })
            .await?;
        let start = WindowStart(start);
        Ok(if claimed {
            Claim::Claimed(start)
        } else {
            Claim::AlreadyRan(start)
        })
    }

    /// 1 round trip, no write.
    async fn current(&self, key: &LockKey, job: &str, length_us: i64) -> Result<Current, Error> {
        let query = sqlx::query_as(CURRENT).bind(job).bind(length_us);
        let (started, left_us): (bool, i64) =
            answered_on_pool(&self.0, (key, RECORD_WITHIN), async |conn| {
                Ok(query.fetch_one(conn).await?)
            })
            .await?;
        Ok(if started {
            Current::Started
        } else {
            Current::Open {
                left: Duration::from_micros(left_us.unsigned_abs()),
            }
        })
    }

    /// 1 round trip, one durable write.
    async fn finish(
        &self,
        key: &LockKey,
        job: &str,
        start: WindowStart,
        outcome: &str,
    ) -> Result<(), Error> {
        let query = sqlx::query(FINISH).bind(job).bind(start.0).bind(outcome);
        answered_on_pool(&self.0, (key, RECORD_WITHIN), async |conn| {
            Ok(query.execute(conn).await?)
        })
        .await?;
        Ok(())
    }
}

impl SingletonJobBuilder {
    /// Runs the job at most once per `window`, recorded in PostgreSQL.
    ///
    /// After taking the lock, the runner inserts (job, window start) into
    /// `distlock.job_runs`; if that row exists, the job already started
    /// in this window and the outcome is
    /// [`JobOutcome::AlreadyRanInWindow`](crate::JobOutcome::AlreadyRanInWindow).
    /// Windows are aligned to the Unix epoch on the database server's clock
    /// (a one-day window starts at midnight UTC), so replicas agree on them
    /// whatever their own clocks say. The job's lock may be on any backend;
    /// the record is on `pool`.
    ///
    /// The row is written *before* the job starts: a replica that crashes
    /// mid-run is not retried within the window (at most once), and neither
    /// is a run that failed, panicked or lost its lock: a transient error
    /// costs the rest of the window. Its
    /// `finished_at` and `outcome` columns record how runs ended; delete a
    /// row to allow another run in that window. The `job` column holds the
    /// key's name for a plain text key, and a name tagged with the key's
    /// kind for the others (`distlock-key:ns:1:report`,
    /// `distlock-key:id:42`, `distlock-key:hashed64:...`), so that two
    /// different locks never share a record; [`build`](Self::build) refuses
    /// a key whose name there would be longer than 1,024 bytes
    /// ([`Error::InvalidKey`](crate::Error::InvalidKey)).
    ///
    /// A tick that finds the job's lock held by a run of another window
    /// tries it again until the window ends (see
    /// [`SingletonJob::run`](crate::SingletonJob::run)): a replica whose
    /// clock is a little ahead claims the window that is ending just as
    /// the others' ticks arrive, and skipping behind it left the new window
    /// to nobody. A tick that finds the current window recorded skips at
    /// once.
    ///
    /// Costs 2 round trips per run (record, finish), each a durable write,
    /// each given up after 5 s without an answer (see
    /// [`SingletonJob::run`](crate::SingletonJob::run)). Needs
    /// [`migrate`](crate::migrate). Range: 1 µs to about 292,000
    /// years (`i64::MAX` microseconds); [`build`](Self::build) refuses
    /// others with [`Error::InvalidSetting`].
    #[must_use = "the setter returns the changed builder"]
    pub fn once_per_window(self, pool: PgPool, window: Duration) -> Self {
        self.run_record(Arc::new(JobRuns(pool)), window)
    }
}
