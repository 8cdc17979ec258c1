//! The worker process: `tasks` tasks taking locks on `keys` keys until told
//! to stop, recording every step in the process's history.
//!
//! The test binary runs itself as a worker (`--exact worker_entry` with the
//! configuration as JSON in [`ENV`]), so no extra `[[bin]]` is needed.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use distlock::{Error, FencingToken, LockKey, PgLocker, SessionLock};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::{PgConnection, PgPoolOptions};
use sqlx::{ConnectOptions, Connection};

use super::db::admin_options;
use super::history::Recorder;

/// The environment variable that turns the test binary into a worker.
pub const ENV: &str = "DISTLOCK_TORTURE_WORKER";

/// A register statement that takes longer than this has an unknown outcome.
const REGISTER_DEADLINE: Duration = Duration::from_secs(15);

/// Which API the tasks use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `try_lock` / `lock` and `release`.
    Session,
    /// `with_advisory_lock` / `with_advisory_lock_wait`.
    Xact,
    /// No lock at all: the control that shows the checker catching
    /// overlaps and lost updates.
    Unlocked,
}

/// A deliberately broken locker, the control that shows a scenario (its
/// fault schedule and the checker's excuse rules) can still fail.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Broken {
    /// Every acquisition is real.
    No,
    /// This share of acquisitions skips the lock and runs the section
    /// anyway, recorded like a real acquisition (without token or pid).
    SkipLock(f64),
    /// This share of session acquisitions releases the lock as soon as it is
    /// granted and runs the section anyway, recorded as held to the end
    /// (with its token and pid). Transaction mode skips the lock instead.
    ReleaseEarly(f64),
}

/// What one worker process does.
#[derive(Debug, Clone)]
pub struct Config {
    pub proc: i64,
    pub dir: PathBuf,
    pub db: String,
    /// Where the worker connects (PostgreSQL, or a proxy in front of it).
    pub port: u16,
    /// Where the final leak check connects (`None`: the server of
    /// `DATABASE_URL`).
    pub check_port: Option<u16>,
    pub mode: Mode,
    pub tasks: usize,
    /// Keys `key_base .. key_base + keys`.
    pub key_base: i64,
    pub keys: i64,
    /// Stop after this many acquisitions in this process (0: no limit).
    pub target: u64,
    /// Stop after this long (0: no limit); a `stop` file in `dir` also stops.
    pub duration_ms: u64,
    pub heartbeat_ms: u64,
    pub heartbeat_timeout_ms: u64,
    pub release_timeout_ms: u64,
    /// Time spent inside the critical section, between read and write.
    pub hold_us: (u64, u64),
    /// Share of acquisitions that wait (`lock`, `with_advisory_lock_wait`).
    pub wait_share: f64,
    pub wait_ms: u64,
    pub lock_pool: u32,
    pub register_pool: u32,
    pub fencing: bool,
    /// Whether session holders' register reads and writes go through the
    /// fence. Without it only the lock keeps two writers apart (the token
    /// is still logged with the write).
    pub fence_register: bool,
    pub register: bool,
    pub broken: Broken,
    pub multiplex: usize,
    /// `with_advisory_lock`'s try goes with its `BEGIN`
    /// (`PgLockerBuilder::try_with_begin`).
    pub try_with_begin: bool,
    /// sqlx's statement cache capacity, when not the default (0 through a
    /// transaction-pooling PgBouncer older than 1.21; see RELIABILITY.md).
    pub statement_cache: Option<usize>,
    pub seed: u64,
}

impl Config {
    /// A session-mode worker with the suite's defaults.
    pub fn new(proc: i64, dir: &Path, db: &str, port: u16, mode: Mode) -> Self {
        Self {
            proc,
            dir: dir.to_owned(),
            db: db.to_owned(),
            port,
            check_port: None,
            mode,
            tasks: 16,
            key_base: 0,
            keys: 16,
            target: 0,
            duration_ms: 0,
            heartbeat_ms: 200,
            heartbeat_timeout_ms: 500,
            release_timeout_ms: 2_000,
            hold_us: (0, 1_000),
            wait_share: 0.3,
            wait_ms: 2_000,
            lock_pool: 6,
            register_pool: 3,
            fencing: mode == Mode::Session,
            fence_register: true,
            register: true,
            broken: Broken::No,
            multiplex: 0,
            try_with_begin: false,
            statement_cache: None,
            seed: super::scale::seed(),
        }
    }

    pub fn to_json(&self) -> String {
        json!({
            "proc": self.proc, "dir": self.dir, "db": self.db, "port": self.port,
            "check_port": self.check_port,
            "mode": match self.mode {
                Mode::Session => "session",
                Mode::Xact => "xact",
                Mode::Unlocked => "unlocked",
            },
            "tasks": self.tasks, "key_base": self.key_base, "keys": self.keys,
            "target": self.target, "duration_ms": self.duration_ms,
            "heartbeat_ms": self.heartbeat_ms, "heartbeat_timeout_ms": self.heartbeat_timeout_ms,
            "release_timeout_ms": self.release_timeout_ms,
            "hold_us": [self.hold_us.0, self.hold_us.1],
            "wait_share": self.wait_share, "wait_ms": self.wait_ms,
            "lock_pool": self.lock_pool, "register_pool": self.register_pool,
            "fencing": self.fencing, "register": self.register,
            "fence_register": self.fence_register,
            "broken": match self.broken {
                Broken::No => json!(null),
                Broken::SkipLock(share) => json!(["skip", share]),
                Broken::ReleaseEarly(share) => json!(["early", share]),
            },
            "multiplex": self.multiplex, "statement_cache": self.statement_cache,
            "try_with_begin": self.try_with_begin,
            "seed": self.seed,
        })
        .to_string()
    }

    pub fn from_json(text: &str) -> Self {
        let v: Value = serde_json::from_str(text).expect("worker configuration");
        let u = |name: &str| v[name].as_u64().unwrap_or_else(|| panic!("config {name}"));
        let i = |name: &str| v[name].as_i64().unwrap_or_else(|| panic!("config {name}"));
        let b = |name: &str| v[name].as_bool().unwrap_or_else(|| panic!("config {name}"));
        let mode = match v["mode"].as_str() {
            Some("session") => Mode::Session,
            Some("xact") => Mode::Xact,
            Some("unlocked") => Mode::Unlocked,
            other => panic!("config mode {other:?}"),
        };
        let hold = |n: usize| v["hold_us"][n].as_u64().expect("config hold_us");
        Self {
            proc: i("proc"),
            dir: PathBuf::from(v["dir"].as_str().expect("config dir")),
            db: v["db"].as_str().expect("config db").to_owned(),
            port: u16::try_from(u("port")).expect("port"),
            check_port: v["check_port"]
                .as_u64()
                .map(|p| u16::try_from(p).expect("check_port")),
            mode,
            tasks: usize::try_from(u("tasks")).expect("tasks"),
            key_base: i("key_base"),
            keys: i("keys"),
            target: u("target"),
            duration_ms: u("duration_ms"),
            heartbeat_ms: u("heartbeat_ms"),
            heartbeat_timeout_ms: u("heartbeat_timeout_ms"),
            release_timeout_ms: u("release_timeout_ms"),
            hold_us: (hold(0), hold(1)),
            wait_share: v["wait_share"].as_f64().expect("config wait_share"),
            wait_ms: u("wait_ms"),
            lock_pool: u32::try_from(u("lock_pool")).expect("lock_pool"),
            register_pool: u32::try_from(u("register_pool")).expect("register_pool"),
            fencing: b("fencing"),
            fence_register: b("fence_register"),
            register: b("register"),
            broken: match (v["broken"][0].as_str(), v["broken"][1].as_f64()) {
                (Some("skip"), Some(share)) => Broken::SkipLock(share),
                (Some("early"), Some(share)) => Broken::ReleaseEarly(share),
                _ => Broken::No,
            },
            multiplex: usize::try_from(u("multiplex")).expect("multiplex"),
            try_with_begin: b("try_with_begin"),
            statement_cache: v["statement_cache"]
                .as_u64()
                .map(|n| usize::try_from(n).expect("statement_cache")),
            seed: u("seed"),
        }
    }

    /// `application_name` of the worker's lock connections.
    pub fn lock_app(proc: i64) -> String {
        format!("torture-w{proc}")
    }
}

/// The lock key of key index `k`: every key shape takes part.
pub fn key_for(k: i64) -> LockKey {
    match k.rem_euclid(3) {
        0 => LockKey::from(format!("torture:{k}")),
        1 => LockKey::id(0x7f00_0000 + k),
        _ => LockKey::namespaced(77, &format!("torture:{k}")),
    }
}

/// Runs the worker described by [`ENV`], if it is set.
pub fn main_from_env() {
    let Ok(text) = std::env::var(ENV) else {
        return;
    };
    let cfg = Config::from_json(&text);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("worker runtime");
    rt.block_on(run(cfg));
}

struct Ctx {
    cfg: Config,
    rec: Recorder,
    locker: PgLocker,
    register: PgPool,
    stop: AtomicBool,
    acquired: AtomicU64,
    deadline: Option<Instant>,
}

impl Ctx {
    fn go(&self) -> bool {
        !self.stop.load(Ordering::Relaxed)
            && (self.cfg.target == 0 || self.acquired.load(Ordering::Relaxed) < self.cfg.target)
            && self.deadline.is_none_or(|d| Instant::now() < d)
    }

    fn emit(&self, w: usize, s: u64, event: &str, mut fields: Value) -> u64 {
        fields["w"] = w.into();
        fields["s"] = s.into();
        self.rec.emit(event, fields)
    }
}

async fn run(cfg: Config) {
    let rec = Recorder::create(&cfg.dir, cfg.proc);
    let app = Config::lock_app(cfg.proc);
    let mut opts = admin_options().database(&cfg.db).port(cfg.port);
    if let Some(capacity) = cfg.statement_cache {
        opts = opts.statement_cache_capacity(capacity);
    }
    let lock_pool = PgPoolOptions::new()
        .max_connections(cfg.lock_pool)
        .acquire_timeout(Duration::from_secs(10))
        .connect_lazy_with(opts.clone().application_name(&app));
    let register = PgPoolOptions::new()
        .max_connections(cfg.register_pool)
        .acquire_timeout(Duration::from_secs(10))
        .connect_lazy_with(opts.application_name(&format!("torture-r{}", cfg.proc)));
    let locker = PgLocker::builder(lock_pool.clone())
        .heartbeat(Duration::from_millis(cfg.heartbeat_ms))
        .heartbeat_timeout(Duration::from_millis(cfg.heartbeat_timeout_ms))
        .release_timeout(Duration::from_millis(cfg.release_timeout_ms))
        .fencing(cfg.fencing)
        .multiplex(cfg.multiplex)
        .try_with_begin(cfg.try_with_begin)
        .build()
        .expect("valid settings");
    let deadline =
        (cfg.duration_ms > 0).then(|| Instant::now() + Duration::from_millis(cfg.duration_ms));
    let ctx = Arc::new(Ctx {
        cfg,
        rec,
        locker,
        register,
        stop: AtomicBool::new(false),
        acquired: AtomicU64::new(0),
        deadline,
    });
    ctx.rec.emit("start", json!({"pid": std::process::id()}));

    let watcher = {
        let ctx = ctx.clone();
        tokio::spawn(async move {
            let stop = ctx.cfg.dir.join("stop");
            loop {
                if stop.exists() {
                    ctx.stop.store(true, Ordering::Relaxed);
                }
                ctx.rec.flush();
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let tasks: Vec<_> = (0..ctx.cfg.tasks)
        .map(|w| {
            let ctx = ctx.clone();
            tokio::spawn(async move {
                match ctx.cfg.mode {
                    Mode::Session => session_task(&ctx, w).await,
                    Mode::Xact => xact_task(&ctx, w).await,
                    Mode::Unlocked => unlocked_task(&ctx, w).await,
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("worker task panicked");
    }
    watcher.abort();

    // Every guard has been released or dropped: none of this process's lock
    // connections may still hold an advisory lock (dropped guards release in
    // the background, so give them a moment).
    let leaked = leak_check(&ctx.cfg).await;
    ctx.rec.emit("leakcheck", json!({"n": leaked}));
    let _ = tokio::time::timeout(Duration::from_secs(5), ctx.locker.pool().close()).await;
    let _ = tokio::time::timeout(Duration::from_secs(5), ctx.register.close()).await;
    ctx.rec.emit(
        "done",
        json!({"acquired": ctx.acquired.load(Ordering::Relaxed)}),
    );
    ctx.rec.flush();
}

/// Advisory locks still held by this process's lock connections, after up
/// to five seconds. Asks PostgreSQL directly, at `check_port` if set (the
/// failover scenario's proxy, which never faults: it only follows the
/// primary).
async fn leak_check(cfg: &Config) -> i64 {
    let mut opts = admin_options()
        .database(&cfg.db)
        .application_name("distlock-torture-check");
    if let Some(port) = cfg.check_port {
        opts = opts.port(port);
    }
    let Ok(mut conn) = opts.connect().await else {
        return -1;
    };
    let app = Config::lock_app(cfg.proc);
    let mut held = -1;
    for _ in 0..100 {
        held = held_by(&mut conn, &app).await;
        if held == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = conn.close().await;
    held
}

async fn held_by(conn: &mut PgConnection, app: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
         WHERE l.locktype = 'advisory' AND a.application_name = $1",
    )
    .bind(app)
    .fetch_one(conn)
    .await
    .unwrap_or(-1)
}

/// Each task's choices follow from the run's seed (`DISTLOCK_TORTURE_SEED`).
fn rng_for(cfg: &Config, w: usize) -> StdRng {
    let proc = u64::try_from(cfg.proc).unwrap_or(0);
    StdRng::seed_from_u64(cfg.seed ^ (proc << 24) ^ (w as u64) ^ 0x7047_7572)
}

/// Whether this acquisition breaks the rules (see [`Broken`]).
fn breaks(cfg: &Config, rng: &mut StdRng) -> Broken {
    match cfg.broken {
        Broken::No => Broken::No,
        b @ (Broken::SkipLock(share) | Broken::ReleaseEarly(share)) => {
            if rng.random_bool(share) {
                b
            } else {
                Broken::No
            }
        }
    }
}

fn hold(cfg: &Config, rng: &mut StdRng) -> Duration {
    let (lo, hi) = cfg.hold_us;
    Duration::from_micros(if hi > lo {
        rng.random_range(lo..=hi)
    } else {
        lo
    })
}

async fn session_task(ctx: &Ctx, w: usize) {
    let mut rng = rng_for(&ctx.cfg, w);
    let mut s = 0;
    while ctx.go() {
        s += 1;
        let k = ctx.cfg.key_base + rng.random_range(0..ctx.cfg.keys);
        let wait = rng.random_bool(ctx.cfg.wait_share);
        let method = if wait { "lock" } else { "try" };
        let broken = breaks(&ctx.cfg, &mut rng);
        ctx.emit(w, s, "invoke", json!({"k": k, "m": method}));
        if matches!(broken, Broken::SkipLock(_)) {
            ctx.acquired.fetch_add(1, Ordering::Relaxed);
            let hold = hold(&ctx.cfg, &mut rng);
            ctx.emit(w, s, "acquired", json!({}));
            ctx.emit(w, s, "entered", json!({"broken": "skip"}));
            session_register(ctx, w, s, k, None, hold).await;
            ctx.emit(w, s, "exited", json!({}));
            ctx.emit(w, s, "released", json!({}));
            continue;
        }
        let attempt = if wait {
            let timeout = Duration::from_millis(ctx.cfg.wait_ms);
            ctx.locker.lock(key_for(k), timeout).await.map(Some)
        } else {
            ctx.locker.try_lock(key_for(k)).await
        };
        match attempt {
            Ok(Some(lock)) => {
                ctx.acquired.fetch_add(1, Ordering::Relaxed);
                let hold = hold(&ctx.cfg, &mut rng);
                if broken == Broken::No {
                    session_held(ctx, w, s, k, lock, hold).await;
                } else {
                    released_early(ctx, w, s, k, lock, hold).await;
                }
            }
            Ok(None) => {
                ctx.emit(w, s, "busy", json!({}));
            }
            Err(Error::Timeout { .. }) => {
                ctx.emit(w, s, "timeout", json!({}));
            }
            Err(err) => {
                ctx.emit(w, s, "failed", json!({"r": err.to_string()}));
                // Do not spin on a broken network.
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// The critical section of a session lock: work, racing `lost()` (which is
/// recorded but, like a careless holder, does not stop the work: the fence
/// has to), then release.
async fn session_held(ctx: &Ctx, w: usize, s: u64, k: i64, lock: SessionLock, hold: Duration) {
    let token = lock.fencing_token();
    ctx.emit(
        w,
        s,
        "acquired",
        json!({"tok": token.map(FencingToken::value), "bp": lock.backend_pid()}),
    );
    ctx.emit(w, s, "entered", json!({}));
    let section = session_register(ctx, w, s, k, token, hold);
    tokio::pin!(section);
    let mut lost = false;
    loop {
        tokio::select! {
            () = &mut section => break,
            reason = lock.lost(), if !lost => {
                ctx.emit(w, s, "lost", json!({"r": reason.to_string(), "via": "lost()"}));
                lost = true;
            }
        }
    }
    ctx.emit(w, s, "exited", json!({}));
    match lock.release().await {
        Ok(()) => {
            ctx.emit(w, s, "released", json!({}));
        }
        Err(Error::LockLost { reason, .. }) => {
            if !lost {
                ctx.emit(
                    w,
                    s,
                    "lost",
                    json!({"r": reason.to_string(), "via": "release"}),
                );
            }
        }
        Err(err) => {
            ctx.emit(w, s, "release_failed", json!({"r": err.to_string()}));
        }
    }
}

/// The broken locker's early release: the lock is let go at once, the
/// section runs anyway and is recorded as if held to the end.
async fn released_early(ctx: &Ctx, w: usize, s: u64, k: i64, lock: SessionLock, hold: Duration) {
    let token = lock.fencing_token();
    ctx.emit(
        w,
        s,
        "acquired",
        json!({"tok": token.map(FencingToken::value), "bp": lock.backend_pid()}),
    );
    let _ = lock.release().await;
    ctx.emit(w, s, "entered", json!({"broken": "early"}));
    session_register(ctx, w, s, k, token, hold).await;
    ctx.emit(w, s, "exited", json!({}));
    ctx.emit(w, s, "released", json!({}));
}

const REGISTER_WRITE: &str = "WITH u AS (UPDATE torture_register SET value = $2 WHERE k = $1 \
     RETURNING k) INSERT INTO torture_register_log (k, value, token, proc, task, seq) \
     SELECT k, $2, $3, $4, $5, $6 FROM u";

/// Read, sleep, write back incremented, on the register's own connections.
/// With a fencing token (and `fence_register`) the read first registers the
/// token with the fence (so an older holder's late write is refused from
/// then on) and the write checks it in its own transaction; without
/// `fence_register` the token is only logged, and the lock alone keeps two
/// writers apart.
async fn session_register(
    ctx: &Ctx,
    w: usize,
    s: u64,
    k: i64,
    token: Option<FencingToken>,
    hold: Duration,
) {
    if !ctx.cfg.register {
        tokio::time::sleep(hold).await;
        return;
    }
    let resource = format!("reg:{k}");
    let key = i32::try_from(k).expect("key index");
    let fence = token.filter(|_| ctx.cfg.fence_register);
    let read = async {
        let mut conn = ctx.register.acquire().await?;
        if let Some(token) = fence {
            distlock::fence::check(&mut conn, &resource, token).await?;
        }
        let value: i64 = sqlx::query_scalar("SELECT value FROM torture_register WHERE k = $1")
            .bind(key)
            .fetch_one(&mut *conn)
            .await?;
        Ok::<_, Error>(value)
    };
    let value = match tokio::time::timeout(REGISTER_DEADLINE, read).await {
        Ok(Ok(value)) => value,
        Ok(Err(Error::StaleFencingToken { .. })) => {
            ctx.emit(w, s, "read_rejected", json!({}));
            return;
        }
        Ok(Err(err)) => {
            ctx.emit(w, s, "reg_failed", json!({"r": err.to_string()}));
            return;
        }
        Err(_) => {
            ctx.emit(w, s, "reg_failed", json!({"r": "read timed out"}));
            return;
        }
    };
    ctx.emit(w, s, "read", json!({"v": value}));
    tokio::time::sleep(hold).await;
    let write = async {
        let mut tx = ctx.register.begin().await?;
        if let Some(token) = fence {
            distlock::fence::check(&mut tx, &resource, token).await?;
        }
        sqlx::query(REGISTER_WRITE)
            .bind(key)
            .bind(value + 1)
            .bind(token.map(FencingToken::value))
            .bind(i32::try_from(ctx.cfg.proc).expect("proc"))
            .bind(i32::try_from(w).expect("task"))
            .bind(i64::try_from(s).expect("seq"))
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok::<_, Error>(())
    };
    match tokio::time::timeout(REGISTER_DEADLINE, write).await {
        Ok(Ok(())) => {
            ctx.emit(w, s, "write", json!({"v": value + 1}));
        }
        Ok(Err(Error::StaleFencingToken { .. })) => {
            ctx.emit(w, s, "write_rejected", json!({}));
        }
        Ok(Err(err)) => {
            ctx.emit(w, s, "reg_failed", json!({"r": err.to_string()}));
        }
        Err(_) => {
            ctx.emit(w, s, "reg_failed", json!({"r": "write timed out"}));
        }
    }
}

/// Records the same history as a session holder, but takes no lock.
async fn unlocked_task(ctx: &Ctx, w: usize) {
    let mut rng = rng_for(&ctx.cfg, w);
    let mut s = 0;
    while ctx.go() {
        s += 1;
        let k = ctx.cfg.key_base + rng.random_range(0..ctx.cfg.keys);
        let hold = hold(&ctx.cfg, &mut rng);
        ctx.emit(w, s, "invoke", json!({"k": k, "m": "none"}));
        ctx.acquired.fetch_add(1, Ordering::Relaxed);
        ctx.emit(w, s, "acquired", json!({}));
        ctx.emit(w, s, "entered", json!({}));
        session_register(ctx, w, s, k, None, hold).await;
        ctx.emit(w, s, "exited", json!({}));
        ctx.emit(w, s, "released", json!({}));
    }
}

async fn xact_task(ctx: &Ctx, w: usize) {
    let mut rng = rng_for(&ctx.cfg, w);
    let mut s = 0;
    while ctx.go() {
        s += 1;
        let k = ctx.cfg.key_base + rng.random_range(0..ctx.cfg.keys);
        let wait = rng.random_bool(ctx.cfg.wait_share);
        let hold = hold(&ctx.cfg, &mut rng);
        let method = if wait { "xwait" } else { "xact" };
        let broken = breaks(&ctx.cfg, &mut rng) != Broken::No;
        ctx.emit(w, s, "invoke", json!({"k": k, "m": method}));
        let entered = AtomicBool::new(false);
        let wrote = AtomicU64::new(0);
        let section = async |conn: &mut PgConnection| {
            ctx.acquired.fetch_add(1, Ordering::Relaxed);
            ctx.emit(w, s, "acquired", json!({}));
            let mark = if broken {
                json!({"broken": "skip"})
            } else {
                json!({})
            };
            ctx.emit(w, s, "entered", mark);
            entered.store(true, Ordering::Relaxed);
            let outcome = xact_register(ctx, w, s, k, hold, conn).await;
            if let Ok(Some(value)) = outcome {
                wrote.store(u64::try_from(value).unwrap_or(0), Ordering::Relaxed);
            }
            ctx.emit(w, s, "exited", json!({}));
            outcome.map(|_| ())
        };
        let outcome = if broken {
            unlocked_transaction(ctx, section).await
        } else if wait {
            let timeout = Duration::from_millis(ctx.cfg.wait_ms);
            ctx.locker
                .with_advisory_lock_wait(key_for(k), timeout, section)
                .await
                .map(Some)
        } else {
            ctx.locker.with_advisory_lock(key_for(k), section).await
        };
        match outcome {
            Ok(Some(())) => {
                ctx.emit(w, s, "released", json!({}));
                let value = wrote.load(Ordering::Relaxed);
                if value > 0 {
                    ctx.emit(w, s, "write", json!({"v": value}));
                }
            }
            Ok(None) => {
                ctx.emit(w, s, "busy", json!({}));
            }
            Err(Error::Timeout { .. }) if !entered.load(Ordering::Relaxed) => {
                ctx.emit(w, s, "timeout", json!({}));
            }
            Err(err) => {
                // After `entered`, the transaction (and with it the lock and
                // the write) did not commit, or its commit is unknown.
                ctx.emit(w, s, "failed", json!({"r": err.to_string()}));
                if !entered.load(Ordering::Relaxed) {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    }
}

/// The broken locker in transaction mode: the section's transaction, on a
/// lock connection, without the advisory lock.
async fn unlocked_transaction(
    ctx: &Ctx,
    section: impl AsyncFnOnce(&mut PgConnection) -> Result<(), Error>,
) -> Result<Option<()>, Error> {
    let mut tx = ctx.locker.pool().begin().await?;
    section(&mut tx).await?;
    tx.commit().await?;
    Ok(Some(()))
}

/// Read, sleep, write back incremented, inside the lock's transaction; no
/// `FOR UPDATE`, so only the advisory lock keeps two holders apart.
/// Returns the value written.
async fn xact_register(
    ctx: &Ctx,
    w: usize,
    s: u64,
    k: i64,
    hold: Duration,
    conn: &mut PgConnection,
) -> Result<Option<i64>, Error> {
    if !ctx.cfg.register {
        tokio::time::sleep(hold).await;
        return Ok(None);
    }
    let key = i32::try_from(k).expect("key index");
    let (value, pid): (i64, i32) =
        sqlx::query_as("SELECT value, pg_backend_pid() FROM torture_register WHERE k = $1")
            .bind(key)
            .fetch_one(&mut *conn)
            .await?;
    ctx.emit(w, s, "read", json!({"v": value, "bp": pid}));
    tokio::time::sleep(hold).await;
    sqlx::query(REGISTER_WRITE)
        .bind(key)
        .bind(value + 1)
        .bind(None::<i64>)
        .bind(i32::try_from(ctx.cfg.proc).expect("proc"))
        .bind(i32::try_from(w).expect("task"))
        .bind(i64::try_from(s).expect("seq"))
        .execute(&mut *conn)
        .await?;
    Ok(Some(value + 1))
}
