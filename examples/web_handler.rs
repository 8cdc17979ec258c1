//! A web handler that charges an order at most once, however often the
//! request arrives.
//!
//! `POST /orders/{id}/charge` with an `Idempotency-Key` header charges under
//! two guards, in one transaction:
//!
//! - a transaction-scoped lock per order (`with_advisory_lock`): a concurrent
//!   duplicate gets `409 Conflict` at once instead of queueing behind the
//!   charge;
//! - an idempotency key (`distlock::idempotency::claim`), committed with the
//!   charge: a retry after the charge gets the stored result back, and even
//!   if the lock were bypassed a second charge could not commit.
//!
//! The example starts the server on 127.0.0.1 (a free port), sends it
//! concurrent duplicates, a retry and a new request, and shows that each
//! order was charged once.
//!
//! ```sh
//! cargo run --example web_handler
//! ```
//!
//! Uses `DATABASE_URL` (default `postgres://postgres@localhost:5432/postgres`),
//! the crate's tables (`distlock::migrate`) and its own schema
//! `distlock_example_web`, recreated on every run.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use distlock::{LockKey, PgLocker};
use sqlx::PgPool;
use sqlx::postgres::{PgConnection, PgPoolOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The lock namespace of this application's per-order locks, so they can
/// never collide with another application's keys in the same database.
const ORDER_LOCKS: i32 = 0x5745; // "WE"
/// The idempotency scope of charges.
const SCOPE: &str = "example:charge";

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@localhost:5432/postgres".to_owned());
    let summary = run(&url).await?;
    if !summary.charged_once() {
        return Err("an order was charged more than once".into());
    }
    Ok(())
}

/// What the client saw, for the caller (and the test) to check.
#[derive(Debug)]
pub struct Summary {
    /// Status codes of the concurrent duplicates for order 1.
    pub duplicates: Vec<u16>,
    /// The retry got the same body as the successful charge.
    pub retry_replayed: bool,
    /// Status of a request with a new key for an order already paid.
    pub new_key_for_paid_order: u16,
    /// (order id, number of charges).
    pub charges: Vec<(i32, i64)>,
}

impl Summary {
    /// Every order was charged exactly once.
    pub fn charged_once(&self) -> bool {
        !self.charges.is_empty() && self.charges.iter().all(|(_, n)| *n == 1)
    }
}

#[derive(Clone)]
struct App {
    locker: PgLocker,
}

/// Starts the server, plays the client, stops the server, reports.
pub async fn run(url: &str) -> Result<Summary, BoxError> {
    let pool = PgPoolOptions::new().max_connections(8).connect(url).await?;
    distlock::migrate(&pool).await?;
    setup(&pool).await?;

    let app = Router::new()
        .route("/orders/{id}/charge", post(charge))
        .with_state(App {
            locker: PgLocker::new(pool.clone()),
        });
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .await
    });
    println!("listening on http://{addr}");

    let summary = client(addr, &pool).await;
    let _ = stop.send(());
    server.await??;
    pool.close().await;
    summary
}

/// The client side: duplicates, a retry, a new key, a second order.
async fn client(addr: SocketAddr, pool: &PgPool) -> Result<Summary, BoxError> {
    println!("\n5 identical requests for order 1 at the same time (Idempotency-Key: pay-1):");
    let mut duplicates = tokio::task::JoinSet::new();
    for _ in 0..5 {
        duplicates.spawn(request(addr, "/orders/1/charge", "pay-1"));
    }
    let mut statuses = Vec::new();
    let mut charged_body = None;
    for reply in duplicates.join_all().await {
        let reply = reply?;
        println!("  {} {}", reply.status, reply.body);
        if reply.status == 200 {
            charged_body = Some(reply.body.clone());
        }
        statuses.push(reply.status);
    }

    println!("\nthe client retries later with the same key:");
    let retry = request(addr, "/orders/1/charge", "pay-1").await?;
    println!("  {} {}{}", retry.status, retry.body, replayed_note(&retry));
    let retry_replayed = retry.replayed && Some(&retry.body) == charged_body.as_ref();

    println!("\na new key for the order that is already paid:");
    let again = request(addr, "/orders/1/charge", "pay-1-again").await?;
    println!("  {} {}", again.status, again.body);

    println!("\norder 2, sent twice one after the other (Idempotency-Key: pay-2):");
    for _ in 0..2 {
        let reply = request(addr, "/orders/2/charge", "pay-2").await?;
        println!("  {} {}{}", reply.status, reply.body, replayed_note(&reply));
    }

    let charges: Vec<(i32, i64)> = sqlx::query_as(
        "SELECT o.id, count(c.id) FROM distlock_example_web.orders o \
         LEFT JOIN distlock_example_web.charges c ON c.order_id = o.id \
         GROUP BY o.id ORDER BY o.id",
    )
    .fetch_all(pool)
    .await?;
    println!();
    for (order, n) in &charges {
        println!("order {order}: charged {n} time(s)");
    }
    let summary = Summary {
        duplicates: statuses,
        retry_replayed,
        new_key_for_paid_order: again.status,
        charges,
    };
    if summary.charged_once() {
        println!("Every order was charged exactly once.");
    }
    Ok(summary)
}

/// Why a charge did not happen (each rolls back the idempotency claim).
enum Refused {
    NotFound,
    AlreadyPaid,
    Database(distlock::Error),
}

impl From<distlock::Error> for Refused {
    fn from(err: distlock::Error) -> Self {
        Self::Database(err)
    }
}

impl From<sqlx::Error> for Refused {
    fn from(err: sqlx::Error) -> Self {
        Self::Database(err.into())
    }
}

/// The handler's result when the charge transaction committed.
enum Charged {
    Now(String),
    Before(String),
}

/// `POST /orders/{id}/charge`.
async fn charge(State(app): State<App>, Path(order): Path<i32>, headers: HeaderMap) -> Response {
    let Some(key) = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
    else {
        return (StatusCode::BAD_REQUEST, "missing Idempotency-Key header").into_response();
    };
    let lock = LockKey::namespaced(ORDER_LOCKS, &format!("order:{order}"));
    let outcome = app
        .locker
        .with_advisory_lock(lock, async |conn| charge_once(conn, order, &key).await)
        .await;
    match outcome {
        Ok(Some(Charged::Now(body))) => (StatusCode::OK, body).into_response(),
        Ok(Some(Charged::Before(body))) => {
            (StatusCode::OK, [("idempotent-replayed", "true")], body).into_response()
        }
        // Contention is not an error: tell the client to retry later.
        Ok(None) => (
            StatusCode::CONFLICT,
            "a request for this order is in progress; retry later",
        )
            .into_response(),
        Err(Refused::NotFound) => (StatusCode::NOT_FOUND, "no such order").into_response(),
        Err(Refused::AlreadyPaid) => {
            (StatusCode::CONFLICT, "this order is already paid").into_response()
        }
        Err(Refused::Database(err)) => {
            eprintln!("charge failed: {err}");
            (StatusCode::INTERNAL_SERVER_ERROR, "internal error").into_response()
        }
    }
}

/// Runs in the transaction that holds the order's lock.
async fn charge_once(conn: &mut PgConnection, order: i32, key: &str) -> Result<Charged, Refused> {
    if !distlock::idempotency::claim(conn, SCOPE, key).await? {
        // Claimed by a committed request: replay its result.
        let stored = match distlock::idempotency::stored(conn, SCOPE, key).await? {
            Some(distlock::idempotency::Once::AlreadyDone { result, .. }) => result,
            _ => None,
        };
        return Ok(Charged::Before(stored.unwrap_or_default()));
    }
    let status: Option<(String, i32)> = sqlx::query_as(
        "SELECT status, amount_cents FROM distlock_example_web.orders WHERE id = $1",
    )
    .bind(order)
    .fetch_optional(&mut *conn)
    .await?;
    let amount = match status {
        None => return Err(Refused::NotFound),
        Some((status, _)) if status == "paid" => return Err(Refused::AlreadyPaid),
        Some((_, amount)) => amount,
    };
    // The payment provider is slow; concurrent duplicates arrive meanwhile.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let charge: i64 = sqlx::query_scalar(
        "INSERT INTO distlock_example_web.charges (order_id, amount_cents) VALUES ($1, $2) RETURNING id",
    )
    .bind(order)
    .bind(amount)
    .fetch_one(&mut *conn)
    .await?;
    sqlx::query("UPDATE distlock_example_web.orders SET status = 'paid' WHERE id = $1")
        .bind(order)
        .execute(&mut *conn)
        .await?;
    let body = format!(
        "charged order {order}: {}.{:02} EUR (charge #{charge})",
        amount / 100,
        amount % 100
    );
    // Stored with the claim, so a retry gets the same answer.
    distlock::idempotency::store(conn, SCOPE, key, &body).await?;
    Ok(Charged::Now(body))
}

/// One HTTP/1.1 reply, as much as the client needs.
struct Reply {
    status: u16,
    replayed: bool,
    body: String,
}

fn replayed_note(reply: &Reply) -> &'static str {
    if reply.replayed {
        "  (stored result)"
    } else {
        ""
    }
}

/// A minimal HTTP/1.1 client: one `POST` per connection.
async fn request(addr: SocketAddr, path: &str, key: &str) -> Result<Reply, BoxError> {
    let mut stream = TcpStream::connect(addr).await?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nIdempotency-Key: {key}\r\n\
         Content-Length: 0\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").ok_or("malformed reply")?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or("no status code")?;
    let replayed = head.lines().any(|line| {
        line.to_ascii_lowercase()
            .starts_with("idempotent-replayed: true")
    });
    Ok(Reply {
        status,
        replayed,
        body: body.to_owned(),
    })
}

/// Recreates the example's schema with two open orders.
async fn setup(pool: &PgPool) -> Result<(), sqlx::Error> {
    for statement in [
        "DROP SCHEMA IF EXISTS distlock_example_web CASCADE",
        "CREATE SCHEMA distlock_example_web",
        "CREATE TABLE distlock_example_web.orders ( \
           id int PRIMARY KEY, amount_cents int NOT NULL, status text NOT NULL DEFAULT 'open')",
        // No unique constraint on order_id on purpose: a double charge must
        // show up in the count, not as an error.
        "CREATE TABLE distlock_example_web.charges ( \
           id bigserial PRIMARY KEY, order_id int NOT NULL, amount_cents int NOT NULL, \
           charged_at timestamptz NOT NULL DEFAULT now())",
        "INSERT INTO distlock_example_web.orders (id, amount_cents) VALUES (1, 1999), (2, 4500)",
        "DELETE FROM distlock.idempotency_keys WHERE scope = 'example:charge'",
    ] {
        sqlx::query(statement).execute(pool).await?;
    }
    Ok(())
}
