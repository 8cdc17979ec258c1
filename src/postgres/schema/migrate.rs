//! The crate's own migrations: schema `distlock` and its tables.

use std::borrow::Cow;
use std::sync::LazyLock;

use sqlx::migrate::{Migration, MigrationType, Migrator as SqlxMigrator};
use sqlx::{PgPool, SqlSafeStr};

use crate::Error;
use crate::postgres::conn::held::HeldConn;
use crate::postgres::request::fragments::keepalives;
use crate::postgres::request::unlimited;

/// The schema holding every object of this crate.
pub const SCHEMA: &str = "distlock";

/// Serialises concurrent `migrate` calls before the schema exists
/// (`CREATE SCHEMA IF NOT EXISTS` is not safe against a concurrent creator).
/// The two-`int4` keyspace with namespace `0x646c` ("dl") keeps it apart from
/// application keys.
const MIGRATE_LOCK: (i32, i32) = (0x646c, 1);

/// Waits for [`MIGRATE_LOCK`] (`$1`, `$2`), after setting the keepalives
/// every lock statement sets (they come first in the select list: a
/// setting a wait's own statement made is in force during the wait only if
/// it acts at once, as the socket options do) and lifting the session's
/// `lock_timeout` for the transaction (read as the wait begins, so the
/// select list's order puts it in force): a role's `lock_timeout` would
/// fail a migrator queued behind another at that limit. Its
/// `statement_timeout` and `transaction_timeout` are lifted by the
/// transaction the wait runs in ([`unlimited::session_wait`]).
const LOCK: &str = concat!(
    "SELECT ",
    keepalives!(),
    ", pg_catalog.set_config('lock_timeout', '0', true)",
    ", pg_catalog.pg_advisory_lock($1, $2)"
);

/// The crate's migrations: version, description and text of each file in
/// `migrations/`. Embedded with `include_str!` rather than `sqlx::migrate!`
/// so that users do not build sqlx's proc macros for them. Version and
/// description are what `sqlx::migrate!` derives from the file name, and
/// [`Migration::new`] computes the checksum over the same text as it does,
/// so a database migrated by a build that used the macro is up to date
/// here. A new file needs a line here: a fresh database then shows one
/// applied migration per file (tests/integration/migrate.rs).
const MIGRATIONS: &[(i64, &str, &str)] = &[
    (
        20261130000001,
        "distlock core",
        include_str!("../../../migrations/20261130000001_distlock_core.sql"),
    ),
    (
        20261201000001,
        "fencing per server lock",
        include_str!("../../../migrations/20261201000001_fencing_per_server_lock.sql"),
    ),
    (
        20261201000002,
        "fencing epoch",
        include_str!("../../../migrations/20261201000002_fencing_epoch.sql"),
    ),
    (
        20261201000003,
        "lease table",
        include_str!("../../../migrations/20261201000003_lease_table.sql"),
    ),
    (
        20261201000009,
        "security",
        include_str!("../../../migrations/20261201000009_security.sql"),
    ),
    (
        20261201000010,
        "lease token after grant",
        include_str!("../../../migrations/20261201000010_lease_token_after_grant.sql"),
    ),
    (
        20261201000011,
        "token epoch after any crash",
        include_str!("../../../migrations/20261201000011_token_epoch_after_any_crash.sql"),
    ),
    (
        20261201000012,
        "lease grant leaner",
        include_str!("../../../migrations/20261201000012_lease_grant_leaner.sql"),
    ),
    (
        20261210000001,
        "leader records",
        include_str!("../../../migrations/20261210000001_leader_records.sql"),
    ),
    (
        20261211000001,
        "token draw in statement",
        include_str!("../../../migrations/20261211000001_token_draw_in_statement.sql"),
    ),
    (
        20261212000001,
        "leader grace pending",
        include_str!("../../../migrations/20261212000001_leader_grace_pending.sql"),
    ),
];

/// The embedded migrations, with their table moved into schema `distlock` so
/// they never mix with the application's own `_sqlx_migrations`. Built once
/// (the checksums are hashes of the texts).
static MIGRATOR: LazyLock<SqlxMigrator> = LazyLock::new(|| {
    let mut migrator = SqlxMigrator::with_migrations(
        MIGRATIONS
            .iter()
            .map(|&(version, description, sql)| {
                Migration::new(
                    version,
                    Cow::Borrowed(description),
                    MigrationType::Simple,
                    sql.into_sql_str(),
                    // What sqlx::migrate! reads as the file's opt-out of a
                    // transaction (no file of this crate uses it).
                    sql.starts_with("-- no-transaction"),
                )
            })
            .collect(),
    );
    migrator.dangerous_set_table_name("distlock._sqlx_migrations");
    migrator
});

/// The crate's migrations, with the roles trusted to own schema `distlock`;
/// [`migrate`] is `Migrator::new().run(pool)`.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), distlock::Error> {
/// distlock::Migrator::new()
///     .allow_schema_owner("distlock_owner")
///     .run(&pool)
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Default)]
#[must_use = "a Migrator does nothing until .run() is called"]
pub struct Migrator {
    allowed_owners: Vec<String>,
}

impl Migrator {
    /// The migrations, trusting schema `distlock` only when the current
    /// role or a superuser owns it.
    pub fn new() -> Self {
        Self::default()
    }

    /// Trusts schema `distlock` when it is owned by `role` too (besides the
    /// current role and superusers, which are always trusted). Use it when
    /// an administrator's role owns the schema and applications migrate at
    /// startup.
    #[must_use = "the setter returns the changed migrator"]
    pub fn allow_schema_owner(mut self, role: impl Into<String>) -> Self {
        self.allowed_owners.push(role.into());
        self
    }

    /// Applies the migrations not yet applied: as [`migrate`], with this
    /// migrator's trusted owners.
    ///
    /// # Cancel safety
    ///
    /// As [`migrate`].
    pub async fn run(&self, pool: &PgPool) -> Result<(), Error> {
        // Armed: if this future is dropped, the session (and its lock) ends.
        let mut conn = HeldConn::new(crate::postgres::conn::pooled::acquire(pool).await?, true);
        // The keepalives first: they take effect at once, so that a
        // migrator cut off while it holds the lock (or waits for it) has
        // its session, and the lock, ended by the server within about
        // 30 s, as a lock's holder does.
        // In a transaction of its own with the session's limits lifted,
        // whether or not it has any (2 round trips more, on a call made
        // once per process start): the lock outlives its `COMMIT`.
        let locked = unlimited::session_wait(conn.conn(), true, async |conn| {
            let locked = sqlx::query(LOCK)
                .bind(MIGRATE_LOCK.0)
                .bind(MIGRATE_LOCK.1)
                .execute(conn);
            crate::span::waiting(&"distlock migrations", locked).await
        });
        locked.await?;
        create_and_run(conn.conn(), self).await?;
        let unlocked: bool = sqlx::query_scalar("SELECT pg_catalog.pg_advisory_unlock($1, $2)")
            .bind(MIGRATE_LOCK.0)
            .bind(MIGRATE_LOCK.1)
            .fetch_one(conn.conn())
            .await?;
        if unlocked {
            conn.into_pool();
        }
        Ok(())
    }
}

/// Applies the crate's migrations (fencing tokens, fence, idempotency keys,
/// job runs), creating schema `distlock` if it does not exist. The same as
/// [`Migrator::new().run(pool)`](Migrator::run).
///
/// Idempotent, and safe to run from many processes at once: they queue on an
/// advisory lock and the later ones find nothing to do. The wait lifts the
/// session's `lock_timeout`, `statement_timeout` and `transaction_timeout`
/// for itself (a role's limit would fail a queued call at that limit), in a
/// transaction of its own: 2 round trips more. That lock is a
/// session lock, held across several statements: run `migrate` on a direct
/// connection, not through a transaction pooler (PgBouncer in transaction
/// mode), where its statements would reach different server sessions and
/// the lock could stay on one of them after the call.
///
/// # Privileges
///
/// A superuser is not needed. The role running it must either own schema
/// `distlock` (created beforehand by an administrator:
/// `CREATE SCHEMA distlock AUTHORIZATION app;`) or may create it
/// (`GRANT CREATE ON DATABASE mydb TO app;`). Other roles that use the
/// schema need the narrow grants the README lists ("Locks, fencing tokens
/// and idempotency keys": `USAGE` on the schema, `EXECUTE` on its
/// functions, reads of the fencing tables and writes of the others), never
/// write privileges on the fencing
/// counters, the floor, the fence or the epoch, with which a role could
/// lower them and have a stale token accepted. The functions that write
/// fencing state run as the schema's owner.
///
/// # Trusted schema
///
/// Whoever owns schema `distlock` can replace the functions in it (a
/// `fence_advance` that accepts every token, say). `migrate` therefore
/// refuses, with [`Error::UntrustedSchema`], a schema owned by a role other
/// than the current one or a superuser, unless a [`Migrator`] allows
/// that owner; it checks this before it reads or runs anything in the
/// schema.
///
/// # Cancel safety
///
/// Dropping the future closes its connection, which frees the lock it holds;
/// a migration in progress is rolled back by the server.
pub async fn migrate(pool: &PgPool) -> Result<(), Error> {
    Migrator::new().run(pool).await
}

/// Whether every embedded migration is already applied, with its checksum.
async fn up_to_date(conn: &mut sqlx::PgConnection) -> Result<bool, Error> {
    let table: Option<String> = sqlx::query_scalar(
        "SELECT pg_catalog.to_regclass('distlock._sqlx_migrations')::pg_catalog.text",
    )
    .fetch_one(&mut *conn)
    .await?;
    if table.is_none() {
        return Ok(false);
    }
    let applied: Vec<(i64, Vec<u8>)> =
        sqlx::query_as("SELECT version, checksum FROM distlock._sqlx_migrations WHERE success")
            .fetch_all(&mut *conn)
            .await?;
    Ok(MIGRATOR.iter().all(|m| {
        applied
            .iter()
            .any(|(version, checksum)| *version == m.version && *checksum == *m.checksum)
    }))
}

/// Fails with [`Error::UntrustedSchema`] unless schema `distlock` is owned
/// by the current role, a superuser, or an allowed role.
async fn check_owner(conn: &mut sqlx::PgConnection, options: &Migrator) -> Result<(), Error> {
    let (owner, trusted): (String, bool) = sqlx::query_as(
        "SELECT r.rolname::pg_catalog.text, r.rolname OPERATOR(pg_catalog.=) current_user OR r.rolsuper \
         FROM pg_catalog.pg_namespace n JOIN pg_catalog.pg_roles r ON r.oid OPERATOR(pg_catalog.=) n.nspowner \
         WHERE n.nspname OPERATOR(pg_catalog.=) $1",
    )
    .bind(SCHEMA)
    .fetch_one(&mut *conn)
    .await?;
    if trusted || options.allowed_owners.contains(&owner) {
        Ok(())
    } else {
        Err(Error::UntrustedSchema {
            schema: SCHEMA.to_owned(),
            owner,
        })
    }
}

async fn create_and_run(conn: &mut sqlx::PgConnection, options: &Migrator) -> Result<(), Error> {
    let exists: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname OPERATOR(pg_catalog.=) $1)",
    )
    .bind(SCHEMA)
    .fetch_one(&mut *conn)
    .await?;
    if !exists {
        // Another role may create it between the check and here (the
        // advisory lock only queues distlock's own callers): the owner is
        // checked below either way.
        sqlx::query("CREATE SCHEMA IF NOT EXISTS distlock")
            .execute(&mut *conn)
            .await?;
    }
    check_owner(conn, options).await?;
    if exists && up_to_date(conn).await? {
        // Nothing to do, and nothing that needs DDL privileges: a role with
        // only the usage grants may call `migrate` at startup too (allowing
        // the schema's owner where that is not itself or a superuser).
        return Ok(());
    }
    // `run_direct` is what `Migrator::run` calls after acquiring; calling it
    // on a plain `&mut PgConnection` avoids sqlx's "implementation of
    // `Acquire` is not general enough" error, which would make this future
    // unusable in `tokio::spawn`.
    MIGRATOR.run_direct(None, conn, false).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::MIGRATOR;
    use sqlx::migrate::Migrator;

    /// The embedded list is the directory, as sqlx resolves it (the same
    /// resolution `sqlx::migrate!` runs at compile time): every file, with
    /// its version, description, checksum and transaction mode.
    #[tokio::test]
    async fn embedded_migrations_are_the_directory_as_sqlx_resolves_it() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
        let resolved = Migrator::new(dir).await.expect("sqlx resolves migrations/");
        let summary = |m: &Migrator| {
            m.iter()
                .map(|m| {
                    (
                        m.version,
                        m.description.to_string(),
                        m.migration_type,
                        m.checksum.to_vec(),
                        m.no_tx,
                    )
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(summary(&MIGRATOR), summary(&resolved));
        assert_ne!(resolved.iter().count(), 0);
    }
}
