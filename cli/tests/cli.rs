//! The `distlock` CLI, spawned as a real process against a test database:
//! one of two concurrent runs skips with 75, `--wait` queues, a lost lock
//! stops the command, `holders` shows a running lock, passwords never show.

// The library's test helpers, shared rather than copied.
#[path = "../../tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use common::*;
use distlock::PgLocker;
use sqlx::PgPool;
use tokio::process::{Child, Command};

const EXIT_BUSY: i32 = 75;
const EXIT_LOST: i32 = 76;
const EXIT_TIMEOUT: i32 = 124;
const EXIT_UNAVAILABLE: i32 = 69;

/// `distlock ARGS` with DATABASE_URL pointing at `url`, output captured.
fn distlock(url: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_distlock"));
    cmd.args(args)
        .env("DATABASE_URL", url)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd
}

async fn finish(child: Child, what: &str) -> Output {
    bounded(what, Duration::from_secs(20), child.wait_with_output())
        .await
        .expect("wait for distlock")
}

fn text(output: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Waits until some session holds `key` (granted); returns its pid.
async fn wait_until_held(pool: &PgPool, key: &str) -> i32 {
    let locker = PgLocker::new(pool.clone());
    let start = Instant::now();
    loop {
        let holders = locker.holders_of(key).await.expect("holders_of");
        if let Some(holder) = holders.iter().find(|h| h.granted) {
            return holder.pid;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{key} never held"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A scratch directory unique to this test run.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "distlock-cli-{name}-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

async fn wait_for_file(path: &Path) -> String {
    let start = Instant::now();
    loop {
        if let Ok(text) = std::fs::read_to_string(path)
            && text.ends_with('\n')
        {
            return text;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{path:?} never written"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Whether process `pid` is running (a zombie waiting to be reaped is not).
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name, which is in parentheses.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// Waits up to `limit` for process `pid` to be gone; `true` if it is.
async fn gone_within(pid: i32, limit: Duration) -> bool {
    let start = Instant::now();
    while alive(pid) {
        if start.elapsed() > limit {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

/// Kills the processes a test started indirectly (a grandchild that outlived
/// distlock) when the test ends, passed or failed.
struct KillOnDrop(Vec<i32>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        for &pid in &self.0 {
            if alive(pid) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
    }
}

/// Reads a pid written by the command into `path`.
async fn read_pid(path: &Path) -> i32 {
    wait_for_file(path)
        .await
        .trim()
        .parse()
        .expect("a pid in the file")
}

/// Terminates the server session holding `key`, as an administrator would.
async fn terminate_holder(pool: &PgPool, key: &str) {
    let holder = wait_until_held(pool, key).await;
    let mut obs = observer_for(pool).await;
    let terminated: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(holder)
        .fetch_one(&mut obs)
        .await
        .expect("terminate");
    assert!(terminated);
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn of_two_concurrent_runs_one_runs_and_the_other_skips(pool: PgPool) {
    let url = url_of(&pool);
    // `sleep 2` rather than 1: both must try while the other holds the lock,
    // even on a loaded machine.
    let a = distlock(&url, &["run", "k", "--", "sleep", "2"])
        .spawn()
        .expect("spawn a");
    let b = distlock(&url, &["run", "k", "--", "sleep", "2"])
        .spawn()
        .expect("spawn b");
    let (a, b) = tokio::join!(finish(a, "run a"), finish(b, "run b"));
    let mut codes = [a.status.code(), b.status.code()];
    codes.sort();
    assert_eq!(
        codes,
        [Some(0), Some(EXIT_BUSY)],
        "{}\n{}",
        text(&a),
        text(&b)
    );
    let skipped = if a.status.code() == Some(EXIT_BUSY) {
        &a
    } else {
        &b
    };
    let stderr = String::from_utf8_lossy(&skipped.stderr);
    assert!(stderr.contains("held elsewhere"), "{stderr}");
    assert!(
        stderr.contains("distlock run k"),
        "names the holder: {stderr}"
    );
}

/// An argument that is not UTF-8 (a Latin-1 file name, say) reaches the
/// command unchanged; reading the arguments for URLs to hide must not stop
/// at it.
#[sqlx::test(migrations = false)]
async fn an_argument_that_is_not_utf8_reaches_the_command(pool: PgPool) {
    use std::os::unix::ffi::OsStrExt;
    let url = url_of(&pool);
    let mut cmd = distlock(&url, &["run", "k", "--", "printf", "%s"]);
    cmd.arg(std::ffi::OsStr::from_bytes(b"caf\xe9"));
    let out = finish(cmd.spawn().expect("spawn"), "run").await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(out.stdout, b"caf\xe9", "{}", text(&out));
}

#[sqlx::test(migrations = false)]
async fn with_wait_the_second_run_follows_the_first(pool: PgPool) {
    let url = url_of(&pool);
    let dir = scratch("wait");
    let log = dir.join("log");
    let log_arg = log.to_string_lossy().into_owned();
    let first = distlock(
        &url,
        &[
            "run",
            "queue",
            "--",
            "sh",
            "-c",
            "echo first-start >> \"$0\"; sleep 1; echo first-end >> \"$0\"",
            &log_arg,
        ],
    )
    .spawn()
    .expect("spawn first");
    wait_until_held(&pool, "queue").await;
    let second = distlock(
        &url,
        &[
            "run",
            "queue",
            "--wait",
            "10s",
            "--",
            "sh",
            "-c",
            "echo second >> \"$0\"",
            &log_arg,
        ],
    )
    .spawn()
    .expect("spawn second");
    let (first, second) = tokio::join!(finish(first, "first"), finish(second, "second"));
    assert_eq!(first.status.code(), Some(0), "{}", text(&first));
    assert_eq!(second.status.code(), Some(0), "{}", text(&second));
    let order = std::fs::read_to_string(&log).expect("log");
    assert_eq!(order, "first-start\nfirst-end\nsecond\n");
    let _ = std::fs::remove_dir_all(dir);
}

#[sqlx::test(migrations = false)]
async fn a_wait_that_runs_out_exits_124_naming_the_holder(pool: PgPool) {
    let url = url_of(&pool);
    let mut obs = observer_for(&pool).await;
    let obs_pid = backend_pid(&mut obs).await;
    assert!(raw_try_lock(&mut obs, &Raw::text("busy")).await);
    let started = Instant::now();
    let out = finish(
        distlock(&url, &["run", "busy", "--wait", "700ms", "--", "true"])
            .spawn()
            .expect("spawn"),
        "timed-out run",
    )
    .await;
    assert_eq!(out.status.code(), Some(EXIT_TIMEOUT), "{}", text(&out));
    assert!(started.elapsed() >= Duration::from_millis(700));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&format!("pid {obs_pid}")), "{stderr}");
    assert!(stderr.contains(OBSERVER_APP), "{stderr}");
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn a_lost_lock_stops_the_command_and_exits_76(pool: PgPool) {
    let url = url_of(&pool);
    let dir = scratch("lost");
    let pid_file = dir.join("pid");
    let pid_arg = pid_file.to_string_lossy().into_owned();
    let run = distlock(
        &url,
        &[
            "run",
            "lost",
            "--heartbeat",
            "200ms",
            "--grace",
            "2s",
            "--",
            "sh",
            "-c",
            "echo $$ > \"$0\"; exec sleep 30",
            &pid_arg,
        ],
    )
    .spawn()
    .expect("spawn");
    let child_pid = wait_for_file(&pid_file).await.trim().to_owned();
    let holder = wait_until_held(&pool, "lost").await;
    let mut obs = observer_for(&pool).await;
    let terminated: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(holder)
        .fetch_one(&mut obs)
        .await
        .expect("terminate");
    assert!(terminated);

    let started = Instant::now();
    let out = finish(run, "run whose lock is lost").await;
    assert_eq!(out.status.code(), Some(EXIT_LOST), "{}", text(&out));
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "stopped promptly"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("was lost"), "{stderr}");
    assert!(
        !Path::new(&format!("/proc/{child_pid}")).exists(),
        "the command (pid {child_pid}) was stopped"
    );
    close(obs).await;
    let _ = std::fs::remove_dir_all(dir);
}

#[sqlx::test(migrations = false)]
async fn sigterm_is_forwarded_to_the_command(pool: PgPool) {
    let url = url_of(&pool);
    let dir = scratch("signal");
    let ready = dir.join("ready");
    let ready_arg = ready.to_string_lossy().into_owned();
    let run = distlock(
        &url,
        &[
            "run",
            "signals",
            "--",
            "sh",
            "-c",
            "trap 'exit 7' TERM; echo ready > \"$0\"; sleep 30 > /dev/null 2>&1 & wait",
            &ready_arg,
        ],
    )
    .spawn()
    .expect("spawn");
    wait_for_file(&ready).await;
    let pid = run.id().expect("pid");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid).expect("pid fits")),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("signal distlock");
    let out = finish(run, "signalled run").await;
    assert_eq!(out.status.code(), Some(7), "{}", text(&out));
    // The lock was released on the way out.
    let mut obs = observer_for(&pool).await;
    assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(3)).await;
    close(obs).await;
    let _ = std::fs::remove_dir_all(dir);
}

#[sqlx::test(migrations = false)]
async fn holders_lists_a_running_lock_as_table_and_json(pool: PgPool) {
    let url = url_of(&pool);
    let run = distlock(&url, &["run", "report:nightly", "--", "sleep", "3"])
        .spawn()
        .expect("spawn");
    let pid = wait_until_held(&pool, "report:nightly").await;

    let table = finish(
        distlock(&url, &["holders"]).spawn().expect("holders"),
        "holders",
    )
    .await;
    assert_eq!(table.status.code(), Some(0), "{}", text(&table));
    let stdout = String::from_utf8_lossy(&table.stdout);
    let header = stdout.lines().next().expect("header");
    for column in ["KEY", "PID", "APPLICATION", "CLIENT", "SINCE", "STATE"] {
        assert!(header.contains(column), "{stdout}");
    }
    assert!(stdout.contains("distlock run report:nightly"), "{stdout}");
    assert!(stdout.contains(&pid.to_string()), "{stdout}");
    assert!(stdout.contains("held"), "{stdout}");
    // SINCE: when, and how long ago.
    assert!(
        stdout.contains("Z (") && stdout.contains(" ago)"),
        "{stdout}"
    );

    let by_name = finish(
        distlock(&url, &["holders", "report:nightly"])
            .spawn()
            .expect("holders KEY"),
        "holders KEY",
    )
    .await;
    let stdout = String::from_utf8_lossy(&by_name.stdout);
    assert!(
        stdout
            .lines()
            .nth(1)
            .expect("a row")
            .starts_with("report:nightly"),
        "{stdout}"
    );

    let json = finish(
        distlock(&url, &["holders", "--json"])
            .spawn()
            .expect("holders --json"),
        "holders --json",
    )
    .await;
    assert_eq!(json.status.code(), Some(0), "{}", text(&json));
    let rows: serde_json::Value = serde_json::from_slice(&json.stdout).expect("valid JSON");
    let rows = rows.as_array().expect("an array");
    let row = rows
        .iter()
        .find(|r| r["pid"] == pid)
        .unwrap_or_else(|| panic!("pid {pid} in {rows:?}"));
    assert_eq!(row["application"], "distlock run report:nightly");
    assert_eq!(row["state"], "held");
    assert_eq!(row["mode"], "exclusive");
    assert!(row["key"].is_string());
    assert!(row["since"].as_str().expect("since").ends_with('Z'));

    let out = finish(run, "run").await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
}

/// What `distlock holders --tree` prints (it must succeed).
async fn tree_of(url: &str) -> String {
    let out = finish(
        distlock(url, &["holders", "--tree"])
            .spawn()
            .expect("holders --tree"),
        "holders --tree",
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Waits until `n` advisory lock requests of the test database wait.
async fn until_waiting(obs: &mut sqlx::PgConnection, n: usize) {
    let n = i64::try_from(n).expect("small");
    let deadline = Instant::now() + Duration::from_secs(10);
    while sqlx::query_scalar::<_, i64>(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
    )
    .fetch_one(&mut *obs)
    .await
    .expect("count waiters")
        < n
    {
        assert!(Instant::now() < deadline, "{n} waits never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `holders --tree` draws the chain A holds 1 ← B waits for 1 (holding 2)
/// ← C waits for 2, indented by depth.
#[sqlx::test(migrations = false)]
async fn holders_tree_draws_who_waits_for_whom(pool: PgPool) {
    use sqlx::Connection;
    let url = url_of(&pool);
    let connect = || async { sqlx::PgConnection::connect(&url).await.expect("connect") };
    let (mut a, mut b, mut c) = (connect().await, connect().await, connect().await);
    async fn pid(conn: &mut sqlx::PgConnection) -> i32 {
        sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(conn)
            .await
            .expect("pid")
    }
    let (pid_a, pid_b, pid_c) = (pid(&mut a).await, pid(&mut b).await, pid(&mut c).await);
    for (conn, key) in [(&mut a, 1), (&mut b, 2)] {
        sqlx::query("SELECT pg_advisory_lock($1::int8)")
            .bind(key)
            .execute(conn)
            .await
            .expect("lock");
    }
    let b_waits = tokio::spawn(async move {
        let _ = sqlx::query("SELECT pg_advisory_lock(1::int8)")
            .execute(&mut b)
            .await;
        b
    });
    let c_waits = tokio::spawn(async move {
        let _ = sqlx::query("SELECT pg_advisory_lock(2::int8)")
            .execute(&mut c)
            .await;
        c
    });
    let mut obs = observer_for(&pool).await;
    until_waiting(&mut obs, 2).await;
    let stdout = tree_of(&url).await;
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{stdout}");
    assert!(
        lines[0].starts_with(&format!("pid {pid_a} holds 1 ")),
        "{stdout}"
    );
    assert!(
        lines[1].starts_with(&format!("└─ pid {pid_b} waits for 1 ")),
        "{stdout}"
    );
    assert!(
        lines[2].starts_with(&format!("   └─ pid {pid_c} waits for 2 ")),
        "{stdout}"
    );
    // --json names whom each waiter waits behind.
    let out = finish(
        distlock(&url, &["holders", "--json"])
            .spawn()
            .expect("holders --json"),
        "holders --json",
    )
    .await;
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let waiting_b = rows
        .as_array()
        .expect("an array")
        .iter()
        .find(|r| r["pid"] == pid_b && r["state"] == "waiting")
        .expect("B's waiting row");
    assert_eq!(waiting_b["waits_for"][0]["pid"], pid_a, "{rows}");
    assert_eq!(waiting_b["waits_for"][0]["state"], "held", "{rows}");
    sqlx::query("SELECT pg_advisory_unlock_all()")
        .execute(&mut a)
        .await
        .expect("unlock a");
    let mut b = b_waits.await.expect("b");
    sqlx::query("SELECT pg_advisory_unlock_all()")
        .execute(&mut b)
        .await
        .expect("unlock b");
    let _ = c_waits.await;
}

/// A queue on one key: each waiter waits for the holder and, in
/// `pg_blocking_pids`, for every waiter queued ahead of it too. `--tree`
/// draws each waiter once, below the holder, in the order they queued
/// (drawn below every waiter ahead as well, a queue of n took 2^n - 1
/// lines: minutes and gigabytes at 30 waiters).
#[sqlx::test(migrations = false)]
async fn holders_tree_draws_a_queue_once_per_waiter(pool: PgPool) {
    use sqlx::Connection;
    const WAITERS: usize = 12;
    let url = url_of(&pool);
    let mut holder = sqlx::PgConnection::connect(&url).await.expect("connect");
    sqlx::query("SELECT pg_advisory_lock(7::int8)")
        .execute(&mut holder)
        .await
        .expect("lock");
    let mut obs = observer_for(&pool).await;
    let mut waiters = Vec::new();
    let mut pids = Vec::new();
    for queued in 1..=WAITERS {
        let mut conn = sqlx::PgConnection::connect(&url).await.expect("connect");
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut conn)
            .await
            .expect("pid");
        pids.push(pid);
        waiters.push(tokio::spawn(async move {
            let _ = sqlx::query("SELECT pg_advisory_lock(7::int8)")
                .execute(&mut conn)
                .await;
        }));
        // The next one queues behind this one.
        until_waiting(&mut obs, queued).await;
    }
    let stdout = tree_of(&url).await;
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 1 + WAITERS, "{} lines", lines.len());
    assert!(lines[0].contains(" holds 7 "), "{stdout}");
    for (line, pid) in lines[1..].iter().zip(&pids) {
        assert!(
            line.starts_with(&format!("└─ pid {pid} waits for 7 ")),
            "{stdout}"
        );
    }
    drop(holder);
    for waiter in waiters {
        waiter.abort();
    }
}

/// Two readers hold key 7, a writer waits for both, and a reader queued
/// behind the writer waits for the writer alone (its request does not
/// conflict with the readers'): the writer is drawn below each reader, the
/// late reader below the writer.
#[sqlx::test(migrations = false)]
async fn holders_tree_draws_a_reader_behind_a_queued_writer(pool: PgPool) {
    use sqlx::Connection;
    let url = url_of(&pool);
    let mut obs = observer_for(&pool).await;
    let mut held = Vec::new();
    let mut sessions = Vec::new();
    for (i, lock) in [
        "pg_advisory_lock_shared",
        "pg_advisory_lock_shared",
        "pg_advisory_lock",
        "pg_advisory_lock_shared",
    ]
    .into_iter()
    .enumerate()
    {
        let mut conn = sqlx::PgConnection::connect(&url).await.expect("connect");
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut conn)
            .await
            .expect("pid");
        sessions.push(pid);
        let sql = format!("SELECT {lock}(7::int8)");
        if i < 2 {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .execute(&mut conn)
                .await
                .expect("lock");
            held.push(conn);
            continue;
        }
        tokio::spawn(async move {
            let _ = sqlx::query(sqlx::AssertSqlSafe(sql))
                .execute(&mut conn)
                .await;
        });
        until_waiting(&mut obs, i - 1).await;
    }
    let (reader_a, reader_b) = (sessions[0].min(sessions[1]), sessions[0].max(sessions[1]));
    let (writer, late) = (sessions[2], sessions[3]);
    let stdout = tree_of(&url).await;
    let lines: Vec<&str> = stdout.lines().collect();
    let expected = [
        format!("pid {reader_a} holds 7 "),
        format!("└─ pid {writer} waits for 7 "),
        format!("   └─ pid {late} waits for 7 "),
        format!("pid {reader_b} holds 7 "),
        format!("└─ pid {writer} waits for 7 "),
        format!("   └─ pid {late} waits for 7 "),
    ];
    assert_eq!(lines.len(), expected.len(), "{stdout}");
    for (line, start) in lines.iter().zip(&expected) {
        assert!(line.starts_with(start.as_str()), "{stdout}");
    }
    drop(held);
}

/// A ring where every session waits (a deadlock the server has not broken
/// yet) has no session that waits for nothing, and is drawn all the same:
/// from its lowest pid round to that pid again, marked as a cycle.
#[sqlx::test(migrations = false)]
async fn holders_tree_draws_a_cycle_where_every_session_waits(pool: PgPool) {
    let ring = cycle::ring(&pool, &[1, 2]).await;
    let (pid_a, pid_b) = (ring.pids[0], ring.pids[1]);
    let stdout = tree_of(&url_of(&pool)).await;
    let lines: Vec<&str> = stdout.lines().collect();
    // The lower pid heads the cycle: what it holds, what it waits for, the
    // other session waiting for it, and the head again, closing the cycle.
    let (head, other, head_waits, other_waits) = if pid_a < pid_b {
        (pid_a, pid_b, 2, 1)
    } else {
        (pid_b, pid_a, 1, 2)
    };
    assert_eq!(lines.len(), 4, "{stdout}");
    assert!(
        lines[0].starts_with(&format!("pid {head} holds {other_waits} ")),
        "{stdout}"
    );
    assert!(
        lines[1].starts_with(&format!("pid {head} waits for {head_waits} ")),
        "{stdout}"
    );
    assert!(
        lines[2].starts_with(&format!("└─ pid {other} waits for {other_waits} ")),
        "{stdout}"
    );
    assert!(
        lines[3].starts_with(&format!("   └─ pid {head} waits for {head_waits} ")),
        "{stdout}"
    );
    assert!(lines[3].ends_with("(a cycle: a deadlock)"), "{stdout}");
    ring.end(&pool).await;
}

#[sqlx::test(migrations = false)]
async fn a_password_never_appears_in_output(pool: PgPool) {
    let opts = pool.connect_options();
    let secret = "s3cret-Pa55word";
    // Trust authentication ignores passwords, so make the connection fail
    // another way: a database that does not exist.
    let bad_url = format!(
        "postgres://{}:{secret}@{}:{}/distlock_no_such_database",
        opts.get_username(),
        opts.get_host(),
        opts.get_port()
    );
    let good_url = url_of(&pool);
    let runs: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["run", "k", "--database-url", &bad_url, "--", "true"],
            good_url.as_str(),
        ),
        (vec!["run", "k", "--", "true"], bad_url.as_str()),
        (vec!["holders"], bad_url.as_str()),
        (
            vec!["holders", "--json", "--database-url", &bad_url],
            good_url.as_str(),
        ),
        (vec!["run", "--help"], bad_url.as_str()),
        (
            vec!["run", "k", "--bogus", &bad_url, "--", "true"],
            good_url.as_str(),
        ),
    ];
    for (args, env_url) in runs {
        let mut cmd = distlock(env_url, &args);
        cmd.env("RUST_LOG", "debug");
        let out = finish(cmd.spawn().expect("spawn"), "run with a password").await;
        let all = text(&out);
        assert!(!all.contains(secret), "password leaked by {args:?}:\n{all}");
        if args[0] == "run" && args.len() > 2 && !args.contains(&"--bogus") {
            assert_eq!(out.status.code(), Some(EXIT_UNAVAILABLE), "{all}");
            assert!(all.contains("could not connect to postgres://"), "{all}");
            assert!(all.contains(":***@"), "the URL is shown redacted: {all}");
        }
    }
}

/// Runs `distlock run` twice at once against Redis (`urls`), expects one run
/// and one skip; then with `--wait`, expects the second to follow.
async fn redis_runs_one_and_skips_one(urls: &[String]) {
    let mut args: Vec<&str> = vec!["run"];
    for url in urls {
        args.extend(["--redis-url", url.as_str()]);
    }
    args.extend(["redis-k", "--", "sleep", "2"]);
    // No DATABASE_URL: the Redis backend needs none.
    let spawn = || {
        let mut cmd = distlock("", &args);
        cmd.env_remove("DATABASE_URL");
        cmd.spawn().expect("spawn distlock")
    };
    let (a, b) = tokio::join!(finish(spawn(), "run a"), finish(spawn(), "run b"));
    let mut codes = [a.status.code(), b.status.code()];
    codes.sort();
    assert_eq!(
        codes,
        [Some(0), Some(EXIT_BUSY)],
        "{}\n{}",
        text(&a),
        text(&b)
    );
}

#[tokio::test]
async fn run_works_with_a_single_redis_instance() {
    let server = common::redis::RedisServer::start().await;
    redis_runs_one_and_skips_one(&[server.url()]).await;
}

#[tokio::test]
async fn run_works_with_redlock_over_three_nodes() {
    let mut servers = Vec::new();
    for _ in 0..3 {
        servers.push(common::redis::RedisServer::start().await);
    }
    let urls: Vec<String> = servers.iter().map(|s| s.url()).collect();
    redis_runs_one_and_skips_one(&urls).await;
}

#[sqlx::test(migrations = false)]
async fn a_lost_lock_stops_the_commands_whole_process_group(pool: PgPool) {
    lost_lock_stops_the_group(&pool, "lost-group", false).await;
}

/// With its stderr a pipe nobody reads any more (a log shipper that died),
/// distlock's "was lost" message fails to print: the command is stopped
/// all the same (a panic there left it running without the lock).
#[sqlx::test(migrations = false)]
async fn a_lost_lock_stops_the_command_though_stderr_is_gone(pool: PgPool) {
    lost_lock_stops_the_group(&pool, "lost-no-stderr", true).await;
}

/// `distlock run KEY` of a shell that waits for a grandchild; the lock's
/// session is terminated: the run exits 76 and the grandchild is gone.
/// With `stderr_gone`, the read end of distlock's stderr is closed first.
async fn lost_lock_stops_the_group(pool: &PgPool, key: &str, stderr_gone: bool) {
    let url = url_of(pool);
    let dir = scratch(key);
    let pid_file = dir.join("pid");
    let pid_arg = pid_file.to_string_lossy().into_owned();
    // The shell waits for a grandchild; SIGTERM to the shell alone would
    // leave `sleep` running without the lock.
    let mut run = distlock(
        &url,
        &[
            "run",
            key,
            "--heartbeat",
            "200ms",
            "--grace",
            "2s",
            "--",
            "sh",
            "-c",
            "sleep 300 > /dev/null 2>&1 & echo $! > \"$0\"; wait",
            &pid_arg,
        ],
    )
    .spawn()
    .expect("spawn");
    if stderr_gone {
        drop(run.stderr.take());
    }
    let grandchild = read_pid(&pid_file).await;
    let _cleanup = KillOnDrop(vec![grandchild]);
    terminate_holder(pool, key).await;

    let out = finish(run, "run whose lock is lost").await;
    assert_eq!(out.status.code(), Some(EXIT_LOST), "{}", text(&out));
    assert!(
        !alive(grandchild),
        "the command's grandchild (pid {grandchild}) still runs after distlock exited:\n{}",
        text(&out)
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[sqlx::test(migrations = false)]
async fn a_forwarded_signal_reaches_the_commands_whole_process_group(pool: PgPool) {
    let url = url_of(&pool);
    let dir = scratch("signal-group");
    let pid_file = dir.join("pid");
    let pid_arg = pid_file.to_string_lossy().into_owned();
    let run = distlock(
        &url,
        &[
            "run",
            "signal-group",
            "--",
            "sh",
            "-c",
            "trap 'exit 7' TERM; sleep 300 > /dev/null 2>&1 & echo $! > \"$0\"; wait",
            &pid_arg,
        ],
    )
    .spawn()
    .expect("spawn");
    let grandchild = read_pid(&pid_file).await;
    let _cleanup = KillOnDrop(vec![grandchild]);
    let pid = run.id().expect("pid");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid).expect("pid fits")),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("signal distlock");
    let out = finish(run, "signalled run").await;
    assert_eq!(out.status.code(), Some(7), "{}", text(&out));
    assert!(
        !alive(grandchild),
        "the command's grandchild (pid {grandchild}) did not get the signal:\n{}",
        text(&out)
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// Under `nohup` (SIGHUP ignored when distlock starts) a hangup reaches
/// neither distlock nor the command, as with `flock(1)`: distlock leaves
/// an ignored signal ignored instead of catching and forwarding it.
#[sqlx::test(migrations = false)]
async fn a_signal_ignored_at_start_stays_ignored_for_the_command(pool: PgPool) {
    let dir = scratch("nohup");
    let pid_file = dir.join("pid");
    // `trap '' HUP` ignores SIGHUP, and `exec` keeps it ignored, as nohup.
    let mut run = Command::new("sh");
    run.args(["-c", "trap '' HUP; exec \"$0\" \"$@\""])
        .arg(env!("CARGO_BIN_EXE_distlock"))
        .args(["run", "nohup", "--", "sh", "-c"])
        .arg("echo $$ > \"$0\"; exec sleep 300")
        .arg(&pid_file)
        .env("DATABASE_URL", url_of(&pool))
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut run = run.spawn().expect("spawn");
    let command = read_pid(&pid_file).await;
    let _cleanup = KillOnDrop(vec![command]);
    let distlock =
        nix::unistd::Pid::from_raw(i32::try_from(run.id().expect("pid")).expect("pid fits"));
    nix::sys::signal::kill(distlock, nix::sys::signal::Signal::SIGHUP).expect("hang up");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(alive(command), "the command died of the hangup");
    assert!(
        run.try_wait().expect("distlock's state").is_none(),
        "distlock died of the hangup"
    );
    nix::sys::signal::kill(distlock, nix::sys::signal::Signal::SIGTERM).expect("terminate");
    let out = finish(run, "terminated run").await;
    assert!(!alive(command), "{}", text(&out));
    let _ = std::fs::remove_dir_all(dir);
}

#[sqlx::test(migrations = false)]
async fn processes_the_command_left_behind_are_stopped_before_the_release(pool: PgPool) {
    let url = url_of(&pool);
    let dir = scratch("leftover");
    let pid_file = dir.join("pid");
    let pid_arg = pid_file.to_string_lossy().into_owned();
    // The command exits at once, leaving a background process in its group.
    let run = distlock(
        &url,
        &[
            "run",
            "leftover",
            "--grace",
            "2s",
            "--",
            "sh",
            "-c",
            "sleep 300 > /dev/null 2>&1 & echo $! > \"$0\"",
            &pid_arg,
        ],
    )
    .spawn()
    .expect("spawn");
    let out = finish(run, "run leaving a process behind").await;
    let grandchild = read_pid(&pid_file).await;
    let _cleanup = KillOnDrop(vec![grandchild]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        !alive(grandchild),
        "a process the command left (pid {grandchild}) runs on after the lock was released:\n{}",
        text(&out)
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// Whether script(1), which runs a command on a pseudo-terminal, is there.
fn have_script() -> bool {
    let found = std::process::Command::new("script")
        .arg("--version")
        .output()
        .is_ok();
    if !found {
        eprintln!("skipped: script(1) is not installed");
    }
    found
}

/// `shell_line`, run by the shell on a pseudo-terminal (script(1)), with DATABASE_URL
/// `url`; its input, output and errors piped.
fn on_terminal(shell_line: &str, url: &str) -> Command {
    let mut script = Command::new("script");
    script
        .args(["-qec", shell_line, "/dev/null"])
        .env("DATABASE_URL", url)
        .env_remove("RUST_LOG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    script
}

#[sqlx::test(migrations = false)]
async fn an_interactive_command_can_read_the_terminal(pool: PgPool) {
    // The command runs in a process group of its own; on a terminal, that
    // group must get the foreground, or reading the terminal stops it
    // (SIGTTIN). `script` runs distlock on a pseudo-terminal.
    if !have_script() {
        return;
    }
    let url = url_of(&pool);
    let inner = format!(
        "{} run tty -- sh -c 'read line; echo got:$line; exit 3'",
        env!("CARGO_BIN_EXE_distlock")
    );
    let mut script = on_terminal(&inner, &url);
    let mut child = script.spawn().expect("spawn script");
    let mut stdin = child.stdin.take().expect("stdin");
    tokio::io::AsyncWriteExt::write_all(&mut stdin, b"hello\n")
        .await
        .expect("type a line");
    let out = finish(child, "interactive run").await;
    drop(stdin);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("got:hello"),
        "{}",
        text(&out)
    );
}

#[sqlx::test(migrations = false)]
async fn a_killed_distlock_takes_the_command_with_it(pool: PgPool) {
    let url = url_of(&pool);
    let dir = scratch("pdeathsig");
    let pid_file = dir.join("pid");
    let pid_arg = pid_file.to_string_lossy().into_owned();
    let mut run = distlock(
        &url,
        &[
            "run",
            "pdeathsig",
            "--",
            "sh",
            "-c",
            "echo $$ > \"$0\"; exec sleep 300",
            &pid_arg,
        ],
    )
    .spawn()
    .expect("spawn");
    let command = read_pid(&pid_file).await;
    let _cleanup = KillOnDrop(vec![command]);
    wait_until_held(&pool, "pdeathsig").await;
    // SIGKILL: distlock cannot stop the command itself.
    run.start_kill().expect("kill -9 distlock");
    let _ = run.wait().await;
    assert!(
        gone_within(command, Duration::from_secs(5)).await,
        "the command (pid {command}) runs on after distlock was killed"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A process the command started lives on after distlock is killed with
/// SIGKILL (the parent-death signal reaches the command only): the lock stays
/// held until that process is gone too, so a second run's command never
/// starts beside it.
#[sqlx::test(migrations = false)]
async fn a_killed_distlock_holds_the_lock_until_the_commands_leftovers_exit(pool: PgPool) {
    let url = url_of(&pool);
    let dir = scratch("leftovers");
    let pid_file = dir.join("pid");
    let pid_arg = pid_file.to_string_lossy().into_owned();
    // `sleep 2` is the command's child: it outlives the shell that the
    // parent-death signal kills.
    let mut first = distlock(
        &url,
        &[
            "run",
            "leftovers",
            "--",
            "sh",
            "-c",
            "sleep 2 & echo $! > \"$0\"; wait",
            &pid_arg,
        ],
    )
    .spawn()
    .expect("spawn the first run");
    let leftover = read_pid(&pid_file).await;
    let _cleanup = KillOnDrop(vec![leftover]);
    wait_until_held(&pool, "leftovers").await;
    first.start_kill().expect("kill -9 the first distlock");
    let _ = first.wait().await;
    assert!(alive(leftover), "the leftover process ended too early");
    // The second command reports whether the leftover still ran when it
    // started.
    let check = format!(
        "if [ -r /proc/{leftover}/stat ] && [ \"$(cut -d' ' -f3 /proc/{leftover}/stat)\" != Z ]; \
         then echo overlap; else echo alone; fi"
    );
    let second = distlock(
        &url,
        &[
            "run",
            "leftovers",
            "--wait",
            "20s",
            "--",
            "sh",
            "-c",
            &check,
        ],
    )
    .output()
    .await
    .expect("the second run");
    assert!(second.status.success(), "{}", text(&second));
    assert_eq!(
        String::from_utf8_lossy(&second.stdout).trim(),
        "alone",
        "the second run's command started while the first command's process \
         (pid {leftover}) still ran"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// Runs a command under `distlock run KEY --heartbeat 10s EXTRA` (the
/// longest) that waits
/// until the test has terminated the lock's session, then exits 0: the loss
/// is found only when the lock is released.
async fn run_with_a_loss_found_at_release(pool: &PgPool, key: &str, extra: &[&str]) -> Output {
    let url = url_of(pool);
    let dir = scratch("release-loss");
    let ready = dir.join("ready");
    let go = dir.join("go");
    let ready_arg = ready.to_string_lossy().into_owned();
    let go_arg = go.to_string_lossy().into_owned();
    let mut args = vec!["run", key, "--heartbeat", "10s"];
    args.extend(extra);
    args.extend([
        "--",
        "sh",
        "-c",
        "echo ready > \"$0\"; while [ ! -e \"$1\" ]; do sleep 0.05; done",
        &ready_arg,
        &go_arg,
    ]);
    let run = distlock(&url, &args).spawn().expect("spawn");
    wait_for_file(&ready).await;
    terminate_holder(pool, key).await;
    std::fs::write(&go, "").expect("let the command finish");
    let out = finish(run, "run whose loss is found at release").await;
    let _ = std::fs::remove_dir_all(dir);
    out
}

#[sqlx::test(migrations = false)]
async fn a_loss_found_at_release_exits_76(pool: PgPool) {
    let out = run_with_a_loss_found_at_release(&pool, "release-loss", &[]).await;
    assert_eq!(out.status.code(), Some(EXIT_LOST), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("lock release-loss"), "{stderr}");
}

#[sqlx::test(migrations = false)]
async fn quiet_still_prints_errors(pool: PgPool) {
    let out = run_with_a_loss_found_at_release(&pool, "quiet-loss", &["--quiet"]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("distlock: ") && stderr.contains("lock quiet-loss"),
        "--quiet hid the error:\n{}",
        text(&out)
    );
    assert_eq!(out.status.code(), Some(EXIT_LOST), "{}", text(&out));
}

/// The value of `DISTLOCK_FENCING_TOKEN` the command saw ("unset" if none),
/// running `distlock run ARGS -- sh -c ...` with `env` added to distlock's
/// environment.
async fn token_seen(url: &str, args: &[&str], env: &[(&str, &str)]) -> String {
    let dir = scratch("token");
    let file = dir.join("token");
    let file_arg = file.to_string_lossy().into_owned();
    let mut all = vec!["run"];
    all.extend(args);
    all.extend([
        "--",
        "sh",
        "-c",
        "echo \"${DISTLOCK_FENCING_TOKEN-unset}\" > \"$0\"",
        &file_arg,
    ]);
    let mut cmd = distlock(url, &all);
    for (name, value) in env {
        cmd.env(name, value);
    }
    let out = finish(cmd.spawn().expect("spawn"), "run showing its token").await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let seen = std::fs::read_to_string(&file).expect("token file");
    let _ = std::fs::remove_dir_all(dir);
    seen.trim().to_owned()
}

#[sqlx::test(migrations = false)]
async fn with_fencing_the_command_gets_the_token_in_its_environment(pool: PgPool) {
    distlock::migrate(&pool).await.expect("migrate");
    let url = url_of(&pool);
    let first: i64 = token_seen(&url, &["--fencing", "fenced"], &[])
        .await
        .parse()
        .expect("a token");
    let second: i64 = token_seen(&url, &["--fencing", "fenced"], &[])
        .await
        .parse()
        .expect("a token");
    assert!(first > 0 && second > first, "{first}, then {second}");
    // Without fencing there is no token, not even one inherited by distlock.
    assert_eq!(
        token_seen(&url, &["fenced"], &[("DISTLOCK_FENCING_TOKEN", "999")]).await,
        "unset"
    );
}

#[tokio::test]
async fn a_single_redis_instance_hands_the_command_its_token() {
    let server = common::redis::RedisServer::start().await;
    let url = server.url();
    let mut cmd_args = vec!["--redis-url", url.as_str(), "redis-fenced"];
    let first: i64 = token_seen("", &cmd_args, &[])
        .await
        .parse()
        .expect("a token");
    cmd_args.push("--quiet");
    let second: i64 = token_seen("", &cmd_args, &[])
        .await
        .parse()
        .expect("a token");
    assert!(first > 0 && second > first, "{first}, then {second}");
}

#[sqlx::test(migrations = false)]
async fn passwords_with_url_delimiters_or_common_words_are_masked_exactly(pool: PgPool) {
    let opts = pool.connect_options();
    let at = format!("{}:{}", opts.get_host(), opts.get_port());
    let user = opts.get_username().to_owned();
    // A '#' or '?' in a password ends the URL's authority for a URL parser;
    // the password must not show anyway.
    // Where what comes before it reads as a port (nothing, or digits), the
    // URL parses, as host `user` and a query holding the rest: it must be
    // refused all the same, before sqlx logs that query as an unknown
    // parameter.
    for secret in [
        "pa#ss-Secret9",
        "pa?ss-Secret9",
        "pa/ss-Secret9",
        "pa@ss-Secret9",
        "?Secret9x-pw",
        "1234?Secret9x",
        "#Secret9x-pw",
        "99/Secret9x-pw",
    ] {
        let url = format!("postgres://{user}:{secret}@{at}/distlock_no_such_database");
        let out = finish(
            distlock(&url, &["holders"]).spawn().expect("spawn"),
            "holders with a password",
        )
        .await;
        let all = text(&out);
        let tail = &secret[3..];
        assert!(!all.contains(tail), "password {secret} leaked:\n{all}");
        assert!(all.contains(&format!("postgres://{user}:***@")), "{all}");
        if secret.contains(['#', '?', '/']) {
            assert_eq!(out.status.code(), Some(EXIT_USAGE), "{secret}: {all}");
        }
    }
    // An '@' in a parameter's value is the URL's own: not refused.
    let url = format!(
        "postgres://{user}@{at}/{}?application_name=app@host",
        opts.get_database().unwrap_or("postgres")
    );
    let out = finish(
        distlock(&url, &["holders"]).spawn().expect("spawn"),
        "holders with an '@' in a parameter's value",
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    // A password that is also a word of the URL masks the password only.
    let url = format!("postgres://{user}:{user}@{at}/distlock_no_such_database");
    let out = finish(
        distlock(&url, &["holders"]).spawn().expect("spawn"),
        "holders with password = user",
    )
    .await;
    let all = text(&out);
    assert!(
        all.contains(&format!(
            "postgres://{user}:***@{at}/distlock_no_such_database"
        )),
        "{all}"
    );
}

#[tokio::test]
async fn redis_urls_can_come_from_the_environment() {
    // Not on the command line, where every user sees it in /proc/*/cmdline.
    let servers = [
        common::redis::RedisServer::start().await,
        common::redis::RedisServer::start().await,
        common::redis::RedisServer::start().await,
    ];
    let run = |urls: String| {
        let mut cmd = distlock("", &["run", "env-redis", "--", "true"]);
        cmd.env_remove("DATABASE_URL")
            .env("DISTLOCK_REDIS_URL", urls);
        cmd.spawn().expect("spawn distlock")
    };
    let single = finish(run(servers[0].url()), "run on one instance").await;
    assert_eq!(single.status.code(), Some(0), "{}", text(&single));
    // Several URLs, separated by spaces: Redlock.
    let urls: Vec<String> = servers.iter().map(|s| s.url()).collect();
    let redlock = finish(run(urls.join(" ")), "run on Redlock").await;
    assert_eq!(redlock.status.code(), Some(0), "{}", text(&redlock));

    // Its password is masked like any other.
    let secret = "s3cret-Redis-pw";
    let unreachable = format!("redis://:{secret}@127.0.0.1:1");
    let failed = finish(run(unreachable), "run on an unreachable Redis").await;
    let all = text(&failed);
    assert_eq!(failed.status.code(), Some(EXIT_UNAVAILABLE), "{all}");
    assert!(!all.contains(secret), "{all}");
    assert!(all.contains("redis://:***@127.0.0.1:1"), "{all}");
}

/// A session lock's `--heartbeat` out of its range (10 ms to 10 s) is a
/// usage error (64) before anything is connected: with the database
/// unreachable it was reported as unreachable (69) instead.
#[tokio::test]
async fn a_heartbeat_out_of_range_is_refused_before_connecting() {
    let out = finish(
        distlock(
            "postgres://postgres@127.0.0.1:1/nowhere",
            &["run", "k", "--heartbeat", "30s", "--", "true"],
        )
        .spawn()
        .expect("spawn"),
        "run with a heartbeat out of range",
    )
    .await;
    assert_eq!(out.status.code(), Some(EXIT_USAGE), "{}", text(&out));
    assert!(text(&out).contains("--heartbeat"), "{}", text(&out));
}

#[sqlx::test(migrations = false)]
async fn huge_durations_saturate_instead_of_panicking(pool: PgPool) {
    let url = url_of(&pool);
    // About the largest duration humantime reads (u64 seconds).
    const HUGE: &str = "500000000000years";
    // A heartbeat has a range: a huge one is refused, not lowered.
    let out = finish(
        distlock(&url, &["run", "huge", "--heartbeat", HUGE, "--", "true"])
            .spawn()
            .expect("spawn"),
        "run with a huge heartbeat",
    )
    .await;
    assert_eq!(out.status.code(), Some(EXIT_USAGE), "{}", text(&out));
    assert!(text(&out).contains("heartbeat"), "{}", text(&out));
    let out = finish(
        distlock(
            &url,
            &[
                "run",
                "huge",
                "--wait",
                HUGE,
                "--grace",
                HUGE,
                "--",
                "sh",
                "-c",
                "sleep 0.3",
            ],
        )
        .spawn()
        .expect("spawn"),
        "run with huge durations",
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));

    // Held elsewhere: the huge wait queues, and ends when the lock is freed.
    let mut obs = observer_for(&pool).await;
    let raw = Raw::text("huge");
    assert!(raw_try_lock(&mut obs, &raw).await);
    let run = distlock(&url, &["run", "huge", "--wait", HUGE, "--", "true"])
        .spawn()
        .expect("spawn");
    wait_for_waiters(&mut obs, 1, Duration::from_secs(10)).await;
    assert!(raw_unlock(&mut obs, &raw).await);
    let out = finish(run, "huge wait").await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    close(obs).await;
}

/// The state letter of process `pid` (`T` stopped, `S` sleeping, ...).
fn state_of(pid: i32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().next().map(str::to_owned)
}

/// Waits until process `pid` is stopped (by a signal, not traced).
async fn until_stopped(pid: i32, what: &str) {
    let start = Instant::now();
    while state_of(pid).as_deref() != Some("T") {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{what} (pid {pid}) was not stopped: state {:?}",
            state_of(pid)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `distlock run --lease-table --heartbeat HEARTBEAT` on a pseudo-terminal,
/// its command writing without pause until `stop_file` exists (then exiting
/// with 7), stopped with Ctrl-Z and continued (`fg`) after `stopped_for`.
struct StoppedRun {
    child: Child,
    out_file: PathBuf,
    stop_file: PathBuf,
    /// Bytes the command had written when it was stopped.
    written: u64,
    /// The terminal's input, open until the run ends.
    _typed: tokio::process::ChildStdin,
}

impl StoppedRun {
    /// `None` where script(1) is missing.
    async fn start(pool: &PgPool, heartbeat: &str, stopped_for: Duration) -> Option<Self> {
        if !have_script() {
            return None;
        }
        distlock::migrate(pool).await.expect("migrate");
        let dir = scratch("ctrl-z");
        let (ppid_file, out_file, stop_file) =
            (dir.join("ppid"), dir.join("out"), dir.join("stop"));
        let inner = format!(
            "{} run --lease-table --heartbeat {heartbeat} --grace 2s stopped -- sh -c \
             'echo $PPID > {}; while [ ! -e {} ]; do echo x; done > {}; exit 7'",
            env!("CARGO_BIN_EXE_distlock"),
            ppid_file.display(),
            stop_file.display(),
            out_file.display()
        );
        let mut script = on_terminal(&inner, &url_of(pool));
        let mut child = script.spawn().expect("spawn script");
        let script_pid = child.id().expect("script's pid") as i32;
        let distlock_pid = read_pid(&ppid_file).await;
        let mut stdin = child.stdin.take().expect("stdin");
        // Ctrl-Z on the terminal: SIGTSTP to its foreground group, the
        // command's; distlock stops itself in turn.
        tokio::io::AsyncWriteExt::write_all(&mut stdin, b"\x1a")
            .await
            .expect("type Ctrl-Z");
        until_stopped(distlock_pid, "distlock").await;
        let written = std::fs::metadata(&out_file).expect("output").len();
        tokio::time::sleep(stopped_for).await;
        assert_eq!(
            std::fs::metadata(&out_file).expect("output").len(),
            written,
            "the command ran while stopped"
        );
        // `fg`: continue distlock (and `script`, if it stopped itself too).
        for pid in [distlock_pid, script_pid] {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGCONT,
            );
        }
        Some(Self {
            child,
            out_file,
            stop_file,
            written,
            _typed: stdin,
        })
    }

    /// Bytes the command wrote after it was stopped.
    fn written_since_stop(&self) -> u64 {
        std::fs::metadata(&self.out_file).expect("output").len() - self.written
    }

    /// Waits for the run to end: its output, and the bytes the command wrote
    /// after it was stopped. Removes the run's scratch directory.
    async fn finish(self, what: &str) -> (Output, u64) {
        let out = finish(self.child, what).await;
        let since = std::fs::metadata(&self.out_file).expect("output").len() - self.written;
        if let Some(dir) = self.out_file.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
        (out, since)
    }
}

#[sqlx::test(migrations = false)]
async fn fg_after_ctrl_z_continues_a_command_whose_lease_holds(pool: PgPool) {
    // TTL 3 s: the lease outlives the 200 ms stop.
    let Some(run) = StoppedRun::start(&pool, "1s", Duration::from_millis(200)).await else {
        return;
    };
    let start = Instant::now();
    while run.written_since_stop() == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the command was not continued"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    std::fs::write(&run.stop_file, "").expect("stop file");
    let (out, _) = run.finish("run continued while its lease held").await;
    assert_eq!(out.status.code(), Some(7), "{}", text(&out));
}

#[sqlx::test(migrations = false)]
async fn fg_after_ctrl_z_does_not_continue_a_command_whose_lease_ran_out(pool: PgPool) {
    // The lease (TTL 900 ms, given up 600 ms after its last renewal) runs
    // out while distlock and the command stay stopped. On `fg`, distlock
    // must find the lease lost before it continues the command: the
    // command writes nothing more.
    let Some(run) = StoppedRun::start(&pool, "300ms", Duration::from_millis(1500)).await else {
        return;
    };
    let (out, since) = run.finish("run continued after its lease ran out").await;
    assert_eq!(out.status.code(), Some(EXIT_LOST), "{}", text(&out));
    assert!(text(&out).contains("was lost"), "{}", text(&out));
    assert_eq!(since, 0, "the command went on without the lock");
}

#[sqlx::test(migrations = false)]
async fn a_command_that_cannot_start_leaves_the_terminal_to_the_caller(pool: PgPool) {
    if !have_script() {
        return;
    }
    let url = url_of(&pool);
    // The shell runs distlock, then prints its own process group and the
    // terminal's foreground group (fields 5 and 8 of /proc/PID/stat).
    let inner = format!(
        "{} run no-start -- /nonexistent/command; cat /proc/self/stat",
        env!("CARGO_BIN_EXE_distlock")
    );
    let mut script = on_terminal(&inner, &url);
    let out = finish(script.spawn().expect("spawn script"), "failed start").await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stat = stdout
        .lines()
        .find(|line| line.contains("(cat)"))
        .unwrap_or_else(|| panic!("no stat line:\n{}", text(&out)));
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .expect("stat")
        .1
        .split_whitespace()
        .collect();
    let (pgrp, foreground) = (fields[2], fields[5]);
    assert!(stdout.contains("cannot run"), "{}", text(&out));
    assert_eq!(
        foreground,
        pgrp,
        "the terminal's foreground group is not the caller's:\n{}",
        text(&out)
    );
}

// ---- --lease-table ------------------------------------------------------------

/// Waits until `distlock.leases` holds `key`.
async fn wait_until_leased(pool: &PgPool, key: &str) {
    eventually(
        &format!("a lease row for {key}"),
        Duration::from_secs(10),
        async || {
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM distlock.leases WHERE key_text = $1)",
            )
            .bind(key)
            .fetch_one(pool)
            .await
            .expect("read leases")
        },
    )
    .await;
}

#[sqlx::test(migrations = false)]
async fn with_lease_table_runs_through_pgbouncer_one_runs_and_the_other_skips(pool: PgPool) {
    distlock::migrate(&pool).await.expect("migrate");
    let bouncer = common::pgbouncer::PgBouncer::start(pool.connect_options().get_port()).await;
    let opts = pool.connect_options();
    let url = format!(
        "postgres://{}@127.0.0.1:{}/{}",
        opts.get_username(),
        bouncer.port(),
        opts.get_database().unwrap_or("postgres")
    );
    let run = || {
        distlock(
            &url,
            &["run", "--lease-table", "nightly", "--", "sleep", "2"],
        )
        .spawn()
        .expect("spawn")
    };
    let (a, b) = (run(), run());
    let (a, b) = tokio::join!(finish(a, "run a"), finish(b, "run b"));
    let mut codes = [a.status.code(), b.status.code()];
    codes.sort();
    assert_eq!(
        codes,
        [Some(0), Some(EXIT_BUSY)],
        "{}\n{}\n{}",
        text(&a),
        text(&b),
        bouncer.log()
    );
    // The environment form, and a fencing token for every run.
    let first: i64 = token_seen(&url, &["nightly"], &[("DISTLOCK_LEASE_TABLE", "1")])
        .await
        .parse()
        .expect("a token");
    let second: i64 = token_seen(&url, &["--lease-table", "nightly"], &[])
        .await
        .parse()
        .expect("a token");
    assert!(first > 0 && second > first, "{first}, then {second}");
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM distlock.leases")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(left, 0, "every run deleted its row");
    // `holders --lease-table` reads the table through the pooler too.
    let out = finish(
        distlock(&url, &["holders", "--lease-table"])
            .spawn()
            .expect("spawn"),
        "holders",
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "no leases are held in distlock.leases\n"
    );
}

/// `distlock holders --lease-table` lists the live leases (key, token,
/// times) as a table or JSON, of one key with KEY, and refuses `--tree`
/// (the table has no waiters). It used to refuse the flag outright.
#[sqlx::test(migrations = false)]
async fn holders_lists_the_lease_tables_leases(pool: PgPool) {
    distlock::migrate(&pool).await.expect("migrate");
    let url = url_of(&pool);
    let locker = distlock::postgres::TableLocker::new(pool.clone());
    let lease = locker
        .try_lock("report:leased")
        .await
        .expect("try")
        .expect("free");
    let token = lease.fencing_token().expect("a token").value().to_string();
    let holders = async |args: &[&str]| {
        let mut all = vec!["holders", "--lease-table"];
        all.extend(args);
        let out = finish(distlock(&url, &all).spawn().expect("spawn"), "holders").await;
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            text(&out),
        )
    };

    let (code, table, all) = holders(&[]).await;
    assert_eq!(code, Some(0), "{all}");
    let mut lines = table.lines();
    let header = lines.next().expect("header");
    for column in ["KEY", "TOKEN", "SINCE", "RENEWED", "EXPIRES"] {
        assert!(header.contains(column), "{table}");
    }
    let line = lines.next().expect("a row");
    let row: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(row[..2], ["report:leased", token.as_str()], "{table}");
    // SINCE says how long ago too, as the advisory table does.
    assert!(
        row[2].ends_with('Z') && row[3].starts_with('(') && line.contains(" ago)"),
        "{table}"
    );
    assert!(lines.next().is_none(), "{table}");

    let (code, json, all) = holders(&["--json"]).await;
    assert_eq!(code, Some(0), "{all}");
    let rows: serde_json::Value = serde_json::from_str(&json).expect("valid JSON");
    let rows = rows.as_array().expect("an array");
    assert_eq!(rows.len(), 1, "{json}");
    assert_eq!(rows[0]["key"], "report:leased");
    assert_eq!(rows[0]["fencing_token"], token.as_str());
    for time in ["since", "renewed", "expires"] {
        assert!(rows[0][time].as_str().expect(time).ends_with('Z'), "{json}");
    }

    let (code, other, all) = holders(&["report:other"]).await;
    assert_eq!(code, Some(0), "{all}");
    assert_eq!(other, "no leases are held in distlock.leases\n");
    // A second lease: KEY lists the one a run of that name would find.
    let second = locker
        .try_lock("report:second")
        .await
        .expect("try")
        .expect("free");
    let (code, mine, all) = holders(&["report:leased"]).await;
    assert_eq!(code, Some(0), "{all}");
    assert_eq!(mine.lines().count(), 2, "{mine}");
    assert!(
        mine.lines()
            .nth(1)
            .expect("a row")
            .starts_with("report:leased "),
        "{mine}"
    );
    let (code, both, all) = holders(&[]).await;
    assert_eq!(code, Some(0), "{all}");
    assert_eq!(both.lines().count(), 3, "{both}");
    second.release().await.expect("release");
    let times: Vec<std::time::SystemTime> = ["since", "renewed", "expires"]
        .map(|time| humantime::parse_rfc3339(rows[0][time].as_str().expect(time)).expect(time))
        .to_vec();
    assert!(times[0] <= times[1] && times[1] < times[2], "{json}");

    // `--tree` is a usage error before anything is connected.
    let out = finish(
        distlock(
            "postgres://nobody@127.0.0.1:1/none",
            &["holders", "--lease-table", "--tree"],
        )
        .spawn()
        .expect("spawn"),
        "holders --tree",
    )
    .await;
    assert_eq!(out.status.code(), Some(64), "{}", text(&out));
    assert!(text(&out).contains("no waiters"), "{}", text(&out));

    // The lease of a running `distlock run --lease-table`, by its name.
    let run = distlock(
        &url,
        &["run", "--lease-table", "report:run", "--", "sleep", "2"],
    )
    .spawn()
    .expect("spawn run");
    wait_until_leased(&pool, "report:run").await;
    let (code, running, all) = holders(&["report:run"]).await;
    assert_eq!(code, Some(0), "{all}");
    assert_eq!(running.lines().count(), 2, "{running}");
    assert!(
        running
            .lines()
            .nth(1)
            .expect("a row")
            .starts_with("report:run "),
        "{running}"
    );
    let out = finish(run, "run").await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));

    lease.release().await.expect("release");
    let (code, none, all) = holders(&[]).await;
    assert_eq!(code, Some(0), "{all}");
    assert_eq!(none, "no leases are held in distlock.leases\n");
}

/// With --lease-table the lease lives three heartbeats: a heartbeat whose
/// TTL the lease table cannot keep is refused (64) before connecting, as a
/// session lock's out-of-range heartbeat is, not changed to fit.
#[sqlx::test(migrations = false)]
async fn with_lease_table_a_heartbeat_out_of_range_is_refused(pool: PgPool) {
    let url = url_of(&pool);
    for heartbeat in ["1ms", "30ms", "9h"] {
        let out = finish(
            distlock(
                &url,
                &[
                    "run",
                    "--lease-table",
                    "hb",
                    "--heartbeat",
                    heartbeat,
                    "--",
                    "true",
                ],
            )
            .spawn()
            .expect("spawn"),
            "run with a heartbeat out of range",
        )
        .await;
        assert_eq!(
            out.status.code(),
            Some(EXIT_USAGE),
            "{heartbeat}: {}",
            text(&out)
        );
        assert!(text(&out).contains("--heartbeat"), "{}", text(&out));
        // The range it names reads in whole milliseconds, not
        // `33ms 333us 333ns`.
        let sub_ms = text(&out).split_whitespace().any(|word| {
            let word = word.trim_end_matches([')', ',']);
            (word.ends_with("us") || word.ends_with("ns"))
                && word[..word.len() - 2].chars().all(|c| c.is_ascii_digit())
                && word.len() > 2
        });
        assert!(!sub_ms, "{}", text(&out));
    }
}

#[sqlx::test(migrations = false)]
async fn with_lease_table_a_lost_lease_stops_the_command_and_exits_76(pool: PgPool) {
    distlock::migrate(&pool).await.expect("migrate");
    let url = url_of(&pool);
    let run = distlock(
        &url,
        &[
            "run",
            "--lease-table",
            "leased",
            "--heartbeat",
            "200ms",
            "--grace",
            "2s",
            "--",
            "sleep",
            "30",
        ],
    )
    .spawn()
    .expect("spawn");
    wait_until_leased(&pool, "leased").await;
    sqlx::query("DELETE FROM distlock.leases")
        .execute(&pool)
        .await
        .expect("delete the lease");
    let started = Instant::now();
    let out = finish(run, "run whose lease is lost").await;
    assert_eq!(out.status.code(), Some(EXIT_LOST), "{}", text(&out));
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "stopped promptly"
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("was lost"),
        "{}",
        text(&out)
    );
}

#[sqlx::test(migrations = false)]
async fn with_lease_table_a_release_that_fails_while_the_lease_holds_keeps_the_exit_code(
    pool: PgPool,
) {
    distlock::migrate(&pool).await.expect("migrate");
    let url = url_of(&pool);
    let run = distlock(
        &url,
        &[
            "run",
            "--lease-table",
            "kept",
            "--",
            "sh",
            "-c",
            "sleep 1; exit 3",
        ],
    )
    .spawn()
    .expect("spawn");
    wait_until_leased(&pool, "kept").await;
    refuse_lease_deletes(&pool).await;
    let out = finish(run, "run whose release fails").await;
    assert_eq!(
        out.status.code(),
        Some(3),
        "the command's own code: {}",
        text(&out)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("releasing lock kept failed") && !stderr.contains("was lost"),
        "{}",
        text(&out)
    );
}

// ---- supervisors killed with SIGKILL, many at once -----------------------------

/// The command under test: it leaves a marker named after its pid while it
/// runs, and records an overlap when another command's marker belongs to a
/// live process (a killed command's marker stays behind, but its process is
/// gone). A process counts as gone once it is exiting: a zombie, or one whose
/// flags (field 9 of `/proc/PID/stat`) carry the kernel's `PF_EXITING`
/// (0x4), set before it closes its files and after which it runs no more
/// code of its own. It looks before and after its work, so two commands that
/// overlap at all see each other.
const MARKED_COMMAND: &str = r#"d="$0"; me=$$
look() {
  for f in "$d"/run.*; do
    [ -e "$f" ] || continue
    p=${f##*.}
    [ "$p" = "$me" ] && continue
    [ -r "/proc/$p/stat" ] || continue
    set -- $(cut -d' ' -f3,9 "/proc/$p/stat" 2>/dev/null)
    [ -n "$1" ] && [ "$1" != Z ] && [ "$1" != X ] || continue
    [ $(( ${2:-4} & 4 )) -eq 0 ] || continue
    echo "$me saw $p" >> "$d/overlaps"
  done
}
: > "$d/run.$me"; look; sleep 0.05; look; rm -f "$d/run.$me""#;

/// The pids of `pid`'s children (over all its threads).
fn children_of(pid: u32) -> Vec<i32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("children")).ok())
        .flat_map(|list| {
            list.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<i32>>()
        })
        .collect()
}

/// Runs `supervisors` loops of the marked command until `run_for` has
/// passed, each run under `distlock run` (or bare, when `locked` is false),
/// while a killer SIGKILLs a random running supervisor every 300–700 ms and
/// checks that the command it supervised is gone within 5 s. Returns
/// (completed runs, kills, commands that outlived their supervisor, overlaps).
async fn marked_runs(
    url: &str,
    locked: bool,
    supervisors: usize,
    run_for: Duration,
) -> (usize, usize, Vec<i32>, String) {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};
    let dir = scratch("supervisors");
    let dir_arg = dir.to_string_lossy().into_owned();
    let running: Arc<Mutex<HashMap<usize, u32>>> = Arc::default();
    let stop = Instant::now() + run_for;
    let mut loops = tokio::task::JoinSet::new();
    for id in 0..supervisors {
        let (url, dir_arg, running) = (url.to_owned(), dir_arg.clone(), running.clone());
        loops.spawn(async move {
            let mut completed = 0;
            while Instant::now() < stop {
                let mut cmd = if locked {
                    distlock(
                        &url,
                        &[
                            "run",
                            "-q",
                            "marked",
                            "--wait",
                            "30s",
                            "--heartbeat",
                            "200ms",
                            "--",
                            "sh",
                        ],
                    )
                } else {
                    let mut bare = Command::new("sh");
                    bare.kill_on_drop(true);
                    bare
                };
                cmd.args(["-c", MARKED_COMMAND, &dir_arg])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null());
                let mut child = cmd.spawn().expect("spawn a supervisor");
                if let Some(pid) = child.id() {
                    running.lock().expect("running").insert(id, pid);
                }
                let status = child.wait().await.expect("wait for a supervisor");
                running.lock().expect("running").remove(&id);
                completed += usize::from(status.success());
            }
            completed
        });
    }
    let mut kills = 0;
    let mut outlived = Vec::new();
    while Instant::now() < stop {
        let pause = 300 + rand::random::<u64>() % 400;
        tokio::time::sleep(Duration::from_millis(pause)).await;
        let victim = {
            let running = running.lock().expect("running");
            let pids: Vec<u32> = running.values().copied().collect();
            (!pids.is_empty()).then(|| pids[rand::random::<u32>() as usize % pids.len()])
        };
        let Some(victim) = victim else { continue };
        let commands = children_of(victim);
        let _cleanup = KillOnDrop(commands.clone());
        let pid = nix::unistd::Pid::from_raw(victim as i32);
        if nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).is_err() {
            continue; // it had just finished
        }
        kills += 1;
        for command in commands {
            if !gone_within(command, Duration::from_secs(5)).await {
                outlived.push(command);
            }
        }
    }
    let mut completed = 0;
    while let Some(done) = loops.join_next().await {
        completed += done.expect("supervisor loop");
    }
    let overlaps = std::fs::read_to_string(dir.join("overlaps")).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    (completed, kills, outlived, overlaps)
}

/// Three supervisors run the same command under one lock while their
/// supervisors are killed at random: the command never runs twice at once,
/// and never runs on after its supervisor died (`PR_SET_PDEATHSIG`).
#[sqlx::test(migrations = false)]
async fn killed_supervisors_never_leave_two_commands_running(pool: PgPool) {
    let url = url_of(&pool);
    let run_for = if std::env::var("DISTLOCK_TORTURE").as_deref() == Ok("full") {
        Duration::from_secs(120)
    } else {
        Duration::from_secs(12)
    };
    let (completed, kills, outlived, overlaps) = marked_runs(&url, true, 3, run_for).await;
    println!(
        "supervisors: {completed} runs completed, {kills} supervisors killed, \
         {} commands outlived them, overlaps: {:?}",
        outlived.len(),
        overlaps.lines().count()
    );
    assert!(kills >= 5, "only {kills} kills");
    assert!(completed >= 10, "only {completed} runs completed");
    assert!(
        outlived.is_empty(),
        "commands outlived their supervisor: {outlived:?}"
    );
    assert!(overlaps.is_empty(), "two commands ran at once:\n{overlaps}");
}

/// Control: the same commands run without distlock overlap, and the check
/// sees it.
#[sqlx::test(migrations = false)]
async fn the_marker_check_sees_commands_run_without_the_lock(pool: PgPool) {
    let url = url_of(&pool);
    let (_, _, _, overlaps) = marked_runs(&url, false, 3, Duration::from_secs(3)).await;
    assert!(
        !overlaps.is_empty(),
        "three unlocked loops never overlapped"
    );
}

// ---- misuse: escalation, Redis URLs, booleans, option combinations -----------

const EXIT_USAGE: i32 = 64;

/// A command that ignores SIGTERM (its whole group: an ignored signal stays
/// ignored across exec) gets SIGKILL once --grace has passed after a SIGTERM
/// forwarded to it.
#[sqlx::test(migrations = false)]
async fn a_forwarded_sigterm_the_command_ignores_is_followed_by_sigkill_after_the_grace(
    pool: PgPool,
) {
    let url = url_of(&pool);
    let dir = scratch("ignores-term");
    let ready = dir.join("ready");
    let ready_arg = ready.to_string_lossy().into_owned();
    let run = distlock(
        &url,
        &[
            "run",
            "ignores-term",
            "--grace",
            "1s",
            "--",
            "sh",
            "-c",
            "trap '' TERM; echo $$ > \"$0\"; while :; do sleep 0.1; done",
            &ready_arg,
        ],
    )
    .spawn()
    .expect("spawn");
    let child = read_pid(&ready).await;
    let _cleanup = KillOnDrop(vec![child]);
    let pid = run.id().expect("pid");
    let signalled = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid).expect("pid fits")),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("signal distlock");
    let out = bounded(
        "distlock after a forwarded SIGTERM the command ignores (--grace 1s)",
        Duration::from_secs(8),
        run.wait_with_output(),
    )
    .await
    .expect("wait for distlock");
    println!(
        "ended {:?} after the SIGTERM\n{}",
        signalled.elapsed(),
        text(&out)
    );
    // Killed by SIGKILL: the shell's 128 + 9.
    assert_eq!(out.status.code(), Some(137), "{}", text(&out));
    assert!(!alive(child), "the command (pid {child}) is gone");
    let mut obs = observer_for(&pool).await;
    assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(3)).await;
    close(obs).await;
    let _ = std::fs::remove_dir_all(dir);
}

/// `distlock run` against Redis only (no DATABASE_URL), with `env` set.
async fn redis_run(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = distlock("", args);
    cmd.env_remove("DATABASE_URL")
        .env_remove("DISTLOCK_REDIS_URL");
    for (name, value) in env {
        cmd.env(name, value);
    }
    finish(cmd.spawn().expect("spawn distlock"), "run on Redis").await
}

#[tokio::test]
async fn malformed_or_blank_redis_urls_are_usage_errors() {
    for bad in [
        "not a url",
        "http://127.0.0.1:6379",
        "redis://127.0.0.1:notaport",
    ] {
        let out = redis_run(&["run", "--redis-url", bad, "k", "--", "true"], &[]).await;
        assert_eq!(
            out.status.code(),
            Some(EXIT_USAGE),
            "{bad:?}: {}",
            text(&out)
        );
    }
    for blank in ["", "   ", " redis://127.0.0.1:1  redis://127.0.0.1:2"] {
        let out = redis_run(
            &["run", "k", "--", "true"],
            &[("DISTLOCK_REDIS_URL", blank)],
        )
        .await;
        let all = text(&out);
        assert_eq!(out.status.code(), Some(EXIT_USAGE), "{blank:?}: {all}");
        assert!(all.contains("empty"), "{blank:?}: {all}");
    }
    let out = redis_run(&["run", "--redis-url", "", "k", "--", "true"], &[]).await;
    assert_eq!(out.status.code(), Some(EXIT_USAGE), "{}", text(&out));
}

#[tokio::test]
async fn one_redis_server_named_twice_is_refused() {
    let server = common::redis::RedisServer::start().await;
    let port = server.port();
    let other = common::redis::RedisServer::start().await;
    let (numeric, named) = (
        format!("redis://127.0.0.1:{port}"),
        format!("redis://localhost:{port}"),
    );
    // Two spellings of one free server ("held elsewhere" before), and the
    // same with a third server (a quorum of one server counted twice).
    for spellings in [
        vec![numeric.clone(), named.clone()],
        vec![numeric.clone(), named.clone(), other.url()],
    ] {
        let mut args = vec!["run"];
        for url in &spellings {
            args.extend(["--redis-url", url.as_str()]);
        }
        args.extend(["dup-nodes", "--", "true"]);
        let out = redis_run(&args, &[]).await;
        let all = text(&out);
        assert_eq!(out.status.code(), Some(EXIT_USAGE), "{spellings:?}: {all}");
        assert!(all.contains("same Redis server"), "{all}");
    }
    // Three different servers are fine.
    let third = common::redis::RedisServer::start().await;
    let urls = [server.url(), other.url(), third.url()];
    let mut args = vec!["run"];
    for url in &urls {
        args.extend(["--redis-url", url.as_str()]);
    }
    args.extend(["dup-nodes", "--", "true"]);
    let out = redis_run(&args, &[]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
}

#[sqlx::test(migrations = false)]
async fn lease_table_takes_only_documented_booleans(pool: PgPool) {
    let url = url_of(&pool);
    for bad in ["maybe", "2", "enabled"] {
        let mut cmd = distlock(&url, &["run", "bool", "--", "true"]);
        cmd.env("DISTLOCK_LEASE_TABLE", bad);
        let out = finish(cmd.spawn().expect("spawn"), "run with a bad boolean").await;
        let all = text(&out);
        assert_eq!(out.status.code(), Some(EXIT_USAGE), "{bad:?}: {all}");
        assert!(
            all.contains("DISTLOCK_LEASE_TABLE") || all.contains("lease-table"),
            "{all}"
        );
    }
    // The documented "off" spellings take a session lock (no schema needed).
    for off in ["0", "false", "no", "off"] {
        let mut cmd = distlock(&url, &["run", "bool", "--", "true"]);
        cmd.env("DISTLOCK_LEASE_TABLE", off);
        let out = finish(cmd.spawn().expect("spawn"), "run with lease table off").await;
        assert_eq!(out.status.code(), Some(0), "{off:?}: {}", text(&out));
    }
}

/// An "off" DISTLOCK_LEASE_TABLE is no lease table: a Redis run goes on
/// (clap counted the variable as given, off or on, and refused every
/// Redis run with it set); an "on" one, or the flag, with Redis is a usage
/// error.
#[tokio::test]
async fn lease_table_off_in_the_environment_leaves_redis_runs_alone() {
    let server = common::redis::RedisServer::start().await;
    let url = server.url();
    let args = ["run", "--redis-url", url.as_str(), "lt-off", "--", "true"];
    for off in ["0", "false", "no", "off"] {
        let out = redis_run(&args, &[("DISTLOCK_LEASE_TABLE", off)]).await;
        assert_eq!(out.status.code(), Some(0), "{off:?}: {}", text(&out));
    }
    let out = redis_run(&args, &[("DISTLOCK_LEASE_TABLE", "1")]).await;
    let all = text(&out);
    assert_eq!(out.status.code(), Some(EXIT_USAGE), "{all}");
    assert!(all.contains("lease-table"), "{all}");
    let flagged = [
        "run",
        "--lease-table",
        "--redis-url",
        url.as_str(),
        "lt",
        "--",
        "true",
    ];
    let out = redis_run(&flagged, &[]).await;
    assert_eq!(out.status.code(), Some(EXIT_USAGE), "{}", text(&out));
}

/// A `DISTLOCK_REDIS_URL` left in the environment does not turn an
/// explicit `--database-url` into a Redis lease (which hosts without the
/// variable would not see): the PostgreSQL lock, held here by another
/// session, is busy. Both URLs on the command line are a usage error.
#[sqlx::test]
async fn database_url_on_the_command_line_beats_redis_from_the_environment(pool: PgPool) {
    let server = common::redis::RedisServer::start().await;
    let url = url_of(&pool);
    let _holder = held_elsewhere(&pool, "explicit-db").await;
    let args = [
        "run",
        "--database-url",
        url.as_str(),
        "explicit-db",
        "--",
        "true",
    ];
    let out = redis_run(&args, &[("DISTLOCK_REDIS_URL", server.url().as_str())]).await;
    assert_eq!(out.status.code(), Some(EXIT_BUSY), "{}", text(&out));
    // From the environment both, Redis first (as documented): the Redis
    // key is free.
    let mut cmd = distlock(&url, &["run", "explicit-db", "--", "true"]);
    cmd.env("DISTLOCK_REDIS_URL", server.url());
    let out = finish(cmd.spawn().expect("spawn"), "both from the environment").await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let redis = server.url();
    let both = [
        "run",
        "--database-url",
        url.as_str(),
        "--redis-url",
        redis.as_str(),
        "explicit-db",
        "--",
        "true",
    ];
    let out = redis_run(&both, &[]).await;
    let all = text(&out);
    assert_eq!(out.status.code(), Some(EXIT_USAGE), "{all}");
    assert!(all.contains("two backends"), "{all}");
}

/// A pooled connection holding the session lock `key`, as another
/// process would.
async fn held_elsewhere(pool: &PgPool, key: &str) -> sqlx::pool::PoolConnection<sqlx::Postgres> {
    let mut holder = pool.acquire().await.expect("acquire");
    sqlx::query("SELECT pg_advisory_lock(hashtext($1))")
        .bind(key)
        .execute(&mut *holder)
        .await
        .expect("hold the key");
    holder
}

/// `holders` is PostgreSQL only: with `DISTLOCK_REDIS_URL` in the
/// environment beside a database URL it lists the database's holders
/// (it connected to Redis, then refused); `--redis-url` on its command
/// line is a usage error before anything is connected (an unreachable
/// Redis made it 69).
#[sqlx::test]
async fn holders_ignores_redis_from_the_environment(pool: PgPool) {
    let url = url_of(&pool);
    let _holder = held_elsewhere(&pool, "held-for-holders").await;
    let mut cmd = distlock(&url, &["holders", "held-for-holders", "--json"]);
    cmd.env("DISTLOCK_REDIS_URL", "redis://127.0.0.1:1");
    let out = finish(cmd.spawn().expect("spawn"), "holders").await;
    let all = text(&out);
    assert_eq!(out.status.code(), Some(0), "{all}");
    assert!(all.contains("held-for-holders"), "{all}");
    let mut cmd = distlock(&url, &["holders", "--redis-url", "redis://127.0.0.1:1"]);
    cmd.env_remove("DISTLOCK_REDIS_URL");
    let out = finish(cmd.spawn().expect("spawn"), "holders --redis-url").await;
    let all = text(&out);
    assert_eq!(out.status.code(), Some(EXIT_USAGE), "{all}");
    assert!(all.contains("PostgreSQL only"), "{all}");
}

#[tokio::test]
async fn heartbeat_with_redis_is_refused() {
    let server = common::redis::RedisServer::start().await;
    let url = server.url();
    let out = redis_run(
        &[
            "run",
            "--redis-url",
            &url,
            "--heartbeat",
            "5s",
            "hb",
            "--",
            "true",
        ],
        &[],
    )
    .await;
    let all = text(&out);
    assert_eq!(out.status.code(), Some(EXIT_USAGE), "{all}");
    assert!(all.contains("--heartbeat"), "{all}");
    // From the environment too.
    let out = redis_run(
        &["run", "--heartbeat", "5s", "hb", "--", "true"],
        &[("DISTLOCK_REDIS_URL", url.as_str())],
    )
    .await;
    assert_eq!(out.status.code(), Some(EXIT_USAGE), "{}", text(&out));
    // Without it, Redis runs.
    let out = redis_run(&["run", "--redis-url", &url, "hb", "--", "true"], &[]).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
}
