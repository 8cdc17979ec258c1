//! Sessions that wait for each other in a ring, as a deadlock does, kept
//! waiting long enough to be looked at.
//!
//! PostgreSQL's deadlock detector breaks a real cycle after
//! `deadlock_timeout` (1 s by default) by failing one of the waits. Each
//! session of the ring sets its own `deadlock_timeout` to 60 s (a superuser
//! setting, which the test role has) before it waits, so the ring stays
//! whole while a test reads it.

use std::time::Duration;

use sqlx::postgres::{PgConnection, PgPool};
use tokio::task::JoinHandle;

use super::{advisory_locks, bounded, eventually, observer_for};

/// A ring of sessions: session `i` holds `keys[i]` and waits for
/// `keys[i + 1]` (the last one for `keys[0]`).
#[derive(Debug)]
pub struct Ring {
    /// The sessions' backend pids, in the order of their keys.
    pub pids: Vec<i32>,
    waits: Vec<JoinHandle<()>>,
}

/// Builds a ring over `keys` (bigint advisory keys, at least two) in the
/// database of `pool`, each session with `application_name` `ring-<i>`, and
/// returns once every session waits.
pub async fn ring(pool: &PgPool, keys: &[i64]) -> Ring {
    assert!(keys.len() >= 2, "a ring needs two keys");
    let mut conns = Vec::new();
    let mut pids = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        let mut conn = observer_for(pool).await;
        sqlx::query(
            "SELECT set_config('deadlock_timeout', '60s', false), \
             set_config('application_name', $1, false)",
        )
        .bind(format!("ring-{i}"))
        .execute(&mut conn)
        .await
        .expect("settings of a ring session");
        let taken: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(key)
            .fetch_one(&mut conn)
            .await
            .expect("take the ring key");
        assert!(taken, "ring key {key} is free");
        pids.push(super::backend_pid(&mut conn).await);
        conns.push(conn);
    }
    let waits = conns
        .into_iter()
        .enumerate()
        .map(|(i, conn)| {
            let next = keys[(i + 1) % keys.len()];
            tokio::spawn(wait_for(conn, next))
        })
        .collect();
    let mut obs = observer_for(pool).await;
    let n = keys.len();
    eventually(
        "every ring session waits",
        Duration::from_secs(10),
        async || {
            advisory_locks(&mut obs)
                .await
                .iter()
                .filter(|r| !r.granted)
                .count()
                >= n
        },
    )
    .await;
    super::close(obs).await;
    Ring { pids, waits }
}

/// Waits for `key` until the session is terminated (its error is the
/// expected end).
async fn wait_for(mut conn: PgConnection, key: i64) {
    let _ = sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(key)
        .execute(&mut conn)
        .await;
}

impl Ring {
    /// Ends the ring: terminates every session (which frees its locks; the
    /// next one in the ring may then get its key and end on its own first).
    pub async fn end(self, pool: &PgPool) {
        let mut obs = observer_for(pool).await;
        sqlx::query("SELECT pg_terminate_backend(p, 5000) FROM unnest($1::int4[]) p")
            .bind(&self.pids)
            .execute(&mut obs)
            .await
            .expect("terminate the ring");
        for wait in self.waits {
            let _ = bounded("a ring session ends", Duration::from_secs(10), wait).await;
        }
        super::close(obs).await;
    }
}
