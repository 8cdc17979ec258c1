//! The crate's own migrations: schema `distlock` and its tables.

use sqlx::PgPool;
use sqlx::migrate::Migrator;

use crate::Error;
use crate::postgres::conn::HeldConn;

/// The schema holding every object of this crate.
pub const SCHEMA: &str = "distlock";

/// Serialises concurrent `migrate` calls before the schema exists
/// (`CREATE SCHEMA IF NOT EXISTS` is not safe against a concurrent creator).
/// The two-`int4` keyspace with namespace `0x646c` ("dl") keeps it apart from
/// application keys.
const MIGRATE_LOCK: (i32, i32) = (0x646c, 1);

/// The embedded migrations, with their table moved into schema `distlock` so
/// they never mix with the application's own `_sqlx_migrations`.
fn migrator() -> Migrator {
    let mut migrator = sqlx::migrate!("./migrations");
    migrator.dangerous_set_table_name("distlock._sqlx_migrations");
    migrator
}

/// Options of [`migrate_with`].
///
/// ```
/// let options = distlock::MigrateOptions::default().allow_schema_owner("distlock_owner");
/// # let _ = options;
/// ```
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct MigrateOptions {
    allowed_owners: Vec<String>,
}

impl MigrateOptions {
    /// Trusts schema `distlock` when it is owned by `role` (besides the
    /// current role and superusers, which are always trusted). Use it when
    /// an administrator's role owns the schema and applications call
    /// `migrate` at startup.
    #[must_use]
    pub fn allow_schema_owner(mut self, role: impl Into<String>) -> Self {
        self.allowed_owners.push(role.into());
        self
    }
}

/// Applies the crate's migrations (fencing tokens, fence, idempotency keys,
/// job runs), creating schema `distlock` if it does not exist. The same as
/// [`migrate_with`] with the default options.
///
/// Idempotent, and safe to run from many processes at once: they queue on an
/// advisory lock and the later ones find nothing to do.
///
/// # Privileges
///
/// A superuser is not needed. The role running it must either own schema
/// `distlock` (created beforehand by an administrator:
/// `CREATE SCHEMA distlock AUTHORIZATION app;`) or may create it
/// (`GRANT CREATE ON DATABASE mydb TO app;`). Other roles that use the tables
/// need `GRANT USAGE ON SCHEMA distlock TO other;`,
/// `GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA distlock TO other;`
/// and `GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA distlock TO other;`.
///
/// # Trusted schema
///
/// Whoever owns schema `distlock` can replace the functions in it (a
/// `fence_advance` that accepts every token, say). `migrate` therefore
/// refuses, with [`Error::UntrustedSchema`], a schema owned by a role other
/// than the current one or a superuser, unless [`MigrateOptions`] allows
/// that owner; it checks this before it reads or runs anything in the
/// schema.
///
/// # Cancel safety
///
/// Dropping the future closes its connection, which frees the lock it holds;
/// a migration in progress is rolled back by the server.
pub async fn migrate(pool: &PgPool) -> Result<(), Error> {
    migrate_with(pool, &MigrateOptions::default()).await
}

/// [`migrate`] with options: which other roles may own schema `distlock`.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), distlock::Error> {
/// let options = distlock::MigrateOptions::default().allow_schema_owner("distlock_owner");
/// distlock::migrate_with(&pool, &options).await?;
/// # Ok(()) }
/// ```
///
/// # Cancel safety
///
/// As [`migrate`].
pub async fn migrate_with(pool: &PgPool, options: &MigrateOptions) -> Result<(), Error> {
    // Armed: if this future is dropped, the session (and its lock) ends.
    let mut conn = HeldConn::new(pool.acquire().await?, true);
    sqlx::query("SELECT pg_advisory_lock($1, $2)")
        .bind(MIGRATE_LOCK.0)
        .bind(MIGRATE_LOCK.1)
        .execute(conn.conn())
        .await?;
    create_and_run(conn.conn(), options).await?;
    let unlocked: bool = sqlx::query_scalar("SELECT pg_advisory_unlock($1, $2)")
        .bind(MIGRATE_LOCK.0)
        .bind(MIGRATE_LOCK.1)
        .fetch_one(conn.conn())
        .await?;
    if unlocked {
        conn.into_pool();
    }
    Ok(())
}

/// Whether every embedded migration is already applied, with its checksum.
async fn up_to_date(conn: &mut sqlx::PgConnection) -> Result<bool, Error> {
    let table: Option<String> =
        sqlx::query_scalar("SELECT to_regclass('distlock._sqlx_migrations')::text")
            .fetch_one(&mut *conn)
            .await?;
    if table.is_none() {
        return Ok(false);
    }
    let applied: Vec<(i64, Vec<u8>)> =
        sqlx::query_as("SELECT version, checksum FROM distlock._sqlx_migrations WHERE success")
            .fetch_all(&mut *conn)
            .await?;
    Ok(migrator().iter().all(|m| {
        applied
            .iter()
            .any(|(version, checksum)| *version == m.version && *checksum == *m.checksum)
    }))
}

/// Fails with [`Error::UntrustedSchema`] unless schema `distlock` is owned
/// by the current role, a superuser, or an allowed role.
async fn check_owner(conn: &mut sqlx::PgConnection, options: &MigrateOptions) -> Result<(), Error> {
    let (owner, trusted): (String, bool) = sqlx::query_as(
        "SELECT r.rolname::text, r.rolname = current_user OR r.rolsuper          FROM pg_catalog.pg_namespace n JOIN pg_catalog.pg_roles r ON r.oid = n.nspowner          WHERE n.nspname = $1",
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

async fn create_and_run(
    conn: &mut sqlx::PgConnection,
    options: &MigrateOptions,
) -> Result<(), Error> {
    let exists: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1)",
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
        // only the usage grants may call `migrate` at startup too.
        return Ok(());
    }
    // `run_direct` is what `Migrator::run` calls after acquiring; calling it
    // on a plain `&mut PgConnection` avoids sqlx's "implementation of
    // `Acquire` is not general enough" error, which would make this future
    // unusable in `tokio::spawn`.
    migrator().run_direct(None, conn, false).await?;
    Ok(())
}
