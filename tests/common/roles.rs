//! Login roles other than the superuser the tests connect as.
//!
//! Roles are cluster-wide while every test has a database of its own, so a
//! role's name ends with a part of its test database's name.

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, Executor};

/// Creates (after dropping any leftover of that name) a login role that is
/// not a superuser and may not create databases or roles, named `prefix`,
/// `_`, and the end of the name of `admin`'s database; returns its name.
pub async fn make_role(admin: &PgPool, prefix: &str) -> String {
    let db: String = sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(admin)
        .await
        .expect("current_database");
    // Unquoted identifiers fold to lower case.
    let suffix: String = db
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .map(|c| c.to_ascii_lowercase())
        .collect();
    let role = format!("{prefix}_{}", &suffix[suffix.len().saturating_sub(10)..]);
    admin
        .execute(AssertSqlSafe(format!(
            "DROP ROLE IF EXISTS {role}; CREATE ROLE {role} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE;"
        )))
        .await
        .expect("create role");
    role
}

/// Drops what `role` owns in `admin`'s database, and the role.
pub async fn drop_role(admin: &PgPool, role: &str) -> sqlx::Result<()> {
    admin
        .execute(AssertSqlSafe(format!(
            "DROP OWNED BY {role} CASCADE; DROP ROLE IF EXISTS {role};"
        )))
        .await
        .map(drop)
}

/// The grants the README documents for an application role (schema
/// `distlock` must exist).
pub async fn grant_documented_rights(admin: &PgPool, role: &str) {
    admin
        .execute(AssertSqlSafe(format!(
            "GRANT USAGE ON SCHEMA distlock TO {role};
             GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA distlock TO {role};
             GRANT SELECT ON distlock._sqlx_migrations, distlock.fence_seen,
                             distlock.fencing_counters TO {role};
             GRANT SELECT, INSERT, UPDATE, DELETE ON distlock.idempotency_keys,
                             distlock.job_runs TO {role};
             GRANT SELECT, INSERT, UPDATE ON distlock.leaders TO {role};
             GRANT SELECT, INSERT, UPDATE, DELETE ON distlock.leases TO {role};
             GRANT USAGE ON SEQUENCE distlock.token_counter TO {role};"
        )))
        .await
        .expect("grant the documented rights");
}

/// A pool of three connections to the database of `opts` as `role`.
pub async fn pool_as(opts: &PgConnectOptions, role: &str) -> PgPool {
    PgPoolOptions::new()
        .max_connections(3)
        .connect_with(opts.clone().username(role))
        .await
        .expect("pool as the role")
}
