//! The per-window run record in `distlock.job_runs`.

use std::time::{Duration, SystemTime};

use sqlx::PgPool;

use crate::Error;

/// What claiming the current window found.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Claim {
    /// This run recorded the window and may run the job.
    Claimed(WindowStart),
    /// A row for the window exists: the job already started in it.
    AlreadyRan(WindowStart),
}

/// A window's start in microseconds since the Unix epoch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WindowStart(i64);

impl WindowStart {
    pub(crate) fn to_system_time(self) -> SystemTime {
        let micros = Duration::from_micros(self.0.unsigned_abs());
        if self.0 >= 0 {
            SystemTime::UNIX_EPOCH + micros
        } else {
            SystemTime::UNIX_EPOCH - micros
        }
    }
}

/// The window is computed from the *server's* clock so that replicas with
/// skewed clocks still agree on it; windows are aligned to the Unix epoch
/// (a one-day window starts at midnight UTC). One statement, one round trip.
const CLAIM: &str = "WITH w AS ( \
       SELECT now_us - (now_us % $2) AS start_us \
       FROM (SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::int8 AS now_us) n \
     ), ins AS ( \
       INSERT INTO distlock.job_runs (job, window_start) \
       SELECT $1, 'epoch'::timestamptz + w.start_us * interval '1 microsecond' FROM w \
       ON CONFLICT (job, window_start) DO NOTHING \
       RETURNING 1 \
     ) \
     SELECT w.start_us, EXISTS (SELECT 1 FROM ins) FROM w";

const FINISH: &str = "UPDATE distlock.job_runs SET finished_at = now(), outcome = $3 \
     WHERE job = $1 AND window_start = 'epoch'::timestamptz + $2 * interval '1 microsecond'";

/// Records (job, current window) unless a record exists.
pub(crate) async fn claim(pool: &PgPool, job: &str, length: Duration) -> Result<Claim, Error> {
    let length_us = i64::try_from(length.as_micros())
        .ok()
        .filter(|us| *us > 0)
        .ok_or(Error::InvalidConfig(
            "a job's run window must be between 1 µs and about 292,000 years",
        ))?;
    let (start, claimed): (i64, bool) = sqlx::query_as(CLAIM)
        .bind(job)
        .bind(length_us)
        .fetch_one(pool)
        .await?;
    let start = WindowStart(start);
    Ok(if claimed {
        Claim::Claimed(start)
    } else {
        Claim::AlreadyRan(start)
    })
}

/// Notes how the run ended (for operators reading the table).
pub(crate) async fn finish(
    pool: &PgPool,
    job: &str,
    start: WindowStart,
    outcome: &str,
) -> Result<(), Error> {
    sqlx::query(FINISH)
        .bind(job)
        .bind(start.0)
        .bind(outcome)
        .execute(pool)
        .await?;
    Ok(())
}
