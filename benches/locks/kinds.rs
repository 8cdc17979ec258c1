//! Latencies of the lock kinds built over `Locker`: how long a freed permit
//! takes to reach a waiting `Semaphore::acquire`, and how long a waiting
//! campaign takes to lead after the leader's backend is terminated.

use std::future::Future;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use anyhow::Context;
use distlock::{LeaderElection, PgLocker, Semaphore};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::stats::us;

/// Latencies in µs of one measurement, sorted.
pub struct Latencies {
    pub what: &'static str,
    pub from: &'static str,
    pub sorted_us: Vec<f64>,
}

impl Latencies {
    fn new(what: &'static str, from: &'static str, samples: Vec<Duration>) -> Self {
        let mut sorted_us: Vec<f64> = samples.into_iter().map(us).collect();
        sorted_us.sort_by(f64::total_cmp);
        Self {
            what,
            from,
            sorted_us,
        }
    }

    fn at(&self, q: f64) -> f64 {
        let n = self.sorted_us.len();
        if n == 0 {
            return f64::NAN;
        }
        self.sorted_us[((n - 1) as f64 * q).round() as usize]
    }
}

async fn pool(opts: &PgConnectOptions, size: u32) -> anyhow::Result<PgPool> {
    Ok(PgPoolOptions::new()
        .max_connections(size)
        .connect_with(opts.clone())
        .await?)
}

/// A 2-permit semaphore, both held by one process; another process waits
/// in `acquire`; one permit is released. From the release's return to the
/// waiter holding a permit.
pub async fn permit_handoff(opts: &PgConnectOptions, trials: usize) -> anyhow::Result<Latencies> {
    let holder_pool = pool(opts, 4).await?;
    let waiter_pool = pool(opts, 4).await?;
    let holder = PgLocker::new(holder_pool.clone()).semaphore("bench-permits", 2)?;
    let waiter = PgLocker::new(waiter_pool.clone()).semaphore("bench-permits", 2)?;
    let mut samples = Vec::with_capacity(trials);
    for _ in 0..trials {
        // The waiter of the round before may still be letting go of the
        // queue: wait for both permits to be free.
        let a = acquire_now(&holder).await?;
        let b = acquire_now(&holder).await?;
        let waiting = {
            let waiter = waiter.clone();
            tokio::spawn(async move {
                let permit = waiter.acquire(Duration::from_secs(10)).await;
                (Instant::now(), permit)
            })
        };
        // Let the waiter reach the server.
        tokio::time::sleep(Duration::from_millis(20)).await;
        a.release().await?;
        let freed = Instant::now();
        let (got, permit) = waiting.await?;
        samples.push(got.saturating_duration_since(freed));
        permit?.release().await?;
        b.release().await?;
    }
    drop((holder, waiter));
    holder_pool.close().await;
    waiter_pool.close().await;
    Ok(Latencies::new(
        "Semaphore(2) permit to a waiting acquire",
        "the holder's release() returned",
        samples,
    ))
}

async fn acquire_now(semaphore: &Semaphore) -> anyhow::Result<distlock::SemaphorePermit> {
    for _ in 0..100 {
        if let Some(permit) = semaphore.try_acquire().await? {
            return Ok(permit);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    anyhow::bail!("no permit free within 1 s")
}

/// A leader and one waiting campaign, each with its own pool of 2; the
/// leader's backend is terminated. From `pg_terminate_backend` returning to
/// the waiting campaign's flag turning true. The winner proclaims itself on
/// a second pooled connection (its lock holds the first): `warm` leaves one
/// idle in the follower's pool, as an application's pool usually has;
/// without it the proclamation opens one.
pub async fn leader_takeover(
    opts: &PgConnectOptions,
    trials: usize,
    warm: bool,
) -> anyhow::Result<Latencies> {
    let admin = pool(opts, 1).await?;
    // Elections on PostgreSQL record their leaders in the crate's schema.
    distlock::migrate(&admin).await?;
    let mut samples = Vec::with_capacity(trials);
    for trial in 0..trials {
        let key = format!("bench-leader-{trial}");
        let leader_pool = pool(opts, 2).await?;
        let follower_pool = pool(opts, 2).await?;
        if warm {
            let (a, b) = tokio::join!(follower_pool.acquire(), follower_pool.acquire());
            drop((a?, b?));
        }
        // Grace 0: the server's hand-off itself. By default a takeover from
        // a leader that did not step down waits 1.25 x (heartbeat +
        // deadline) on top, so the deposed leader knows first.
        let election = |pool: &PgPool| {
            LeaderElection::builder(Arc::new(PgLocker::new(pool.clone())), key.as_str())
                .grace(Duration::ZERO)
                .build()
        };
        let leader = election(&leader_pool)?.campaign();
        leader
            .leadership()
            .wait_for(|l| *l)
            .await
            .context("leader campaign ended")?;
        let follower = election(&follower_pool)?.campaign();
        let mut following = follower.leadership();
        // Let the follower's wait reach the server.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let killed: i64 = sqlx::query_scalar(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_locks \
             WHERE locktype = 'advisory' AND granted AND objsubid = 1 \
             AND objid::bigint = hashtext($1)::bigint & 4294967295 \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .bind(&key)
        .fetch_one(&admin)
        .await?;
        anyhow::ensure!(killed == 1, "expected one leader backend, found {killed}");
        let freed = Instant::now();
        tokio::time::timeout(Duration::from_secs(10), following.wait_for(|l| *l))
            .await
            .context("no takeover within 10 s")?
            .context("follower campaign ended")?;
        samples.push(freed.elapsed());
        let _ = tokio::join!(leader.resign(), follower.resign());
        leader_pool.close().await;
        follower_pool.close().await;
    }
    admin.close().await;
    Ok(Latencies::new(
        if warm {
            "LeaderElection takeover by a waiting campaign (grace 0), an idle connection in its pool"
        } else {
            "LeaderElection takeover by a waiting campaign (grace 0), its pool opens a connection"
        },
        "pg_terminate_backend(leader) returned",
        samples,
    ))
}

/// What the semaphore at scale did: 200 waiters, 10 permits, one pool.
pub struct SemaphoreScale {
    /// "new": the pool's connections had run no statement of the semaphore
    /// before the burst; "used": they had (a burst ran before).
    pub connections: &'static str,
    pub waiters: usize,
    pub permits: u32,
    pub pool: u32,
    pub hold: Duration,
    /// Release of a permit to the grant it made room for, while waiters
    /// queued: the k-th release to the (k + permits)-th grant.
    pub handoff: Latencies,
    pub most_holders: usize,
    /// Permit-time held over permits × the time waiters queued.
    pub utilisation: f64,
    /// The same from the grant that took the last free permit on: the
    /// first grants go through the server while the 200 tasks start, so
    /// this leaves out the ramp.
    pub utilisation_after_ramp: f64,
    /// The slots taken on the server (sampled from `pg_locks` on a
    /// connection of its own) over permits, averaged over the samples taken
    /// while waiters queued after the ramp. A permit handed from a holder
    /// to a waiter of its process stays taken on the server throughout.
    pub server_taken: f64,
    /// The ramp: from the first grant to the grant that took the last free
    /// permit.
    pub ramp: Duration,
    /// The furthest a waiter was served from its ticket's place (see
    /// [`Arrival`]).
    pub displaced: usize,
    /// The most waiters that surely arrived after one waiter (their first
    /// poll began after its first poll ended) and were served before it.
    pub overtaken: usize,
    pub errors: usize,
    pub first_error: Option<String>,
    pub took: Duration,
}

/// When a waiter of [`semaphore_scale`] joined the line.
#[derive(Debug, Clone, Copy)]
struct Arrival {
    /// Taken just before the call: the order of tickets is the order of
    /// arrival unless the thread was preempted between the ticket and the
    /// call's first poll (on 2 cores, that happens: a worker preempted for a
    /// few ms while the other registers dozens of waiters).
    ticket: usize,
    /// Just before the call's first poll, in which it joins the line.
    from: Instant,
    /// Just after it.
    by: Instant,
}

/// `waiters` tasks of one process call `acquire` on one semaphore of
/// `permits` permits over one pool of `pool` connections, each keeping its
/// permit for `hold`; every acquisition and release is time-stamped. Two
/// bursts on the same pool, one after the other: the first on connections
/// that have run no statement of the semaphore yet (a new backend's first
/// statements read the catalog and plan each statement, ms each), the
/// second on the same connections, as a service's pool is after its first
/// minutes.
pub async fn semaphore_scale(
    opts: &PgConnectOptions,
    (waiters, permits, pool_size): (usize, u32, u32),
    hold: Duration,
) -> anyhow::Result<[SemaphoreScale; 2]> {
    let pool = pool(opts, pool_size).await?;
    // Every connection of the pool is open before the run (opening one
    // takes tens of ms, and would be counted as a hand-off).
    let mut open = Vec::new();
    for _ in 0..pool_size {
        open.push(pool.acquire().await?);
    }
    drop(open);
    let name = "bench-semaphore-scale";
    let semaphore = PgLocker::new(pool.clone()).semaphore(name, permits)?;
    let burst = Burst {
        opts,
        semaphore: &semaphore,
        name,
        waiters,
        permits,
        pool: pool_size,
        hold,
    };
    let new = burst.run("new").await?;
    let used = burst.run("used").await?;
    pool.close().await;
    Ok([new, used])
}

/// One burst of [`semaphore_scale`].
struct Burst<'a> {
    opts: &'a PgConnectOptions,
    semaphore: &'a Semaphore,
    name: &'a str,
    waiters: usize,
    permits: u32,
    pool: u32,
    hold: Duration,
}

impl Burst<'_> {
    /// `connections`: whether the pool's connections are new or used.
    async fn run(&self, connections: &'static str) -> anyhow::Result<SemaphoreScale> {
        let Self {
            opts,
            semaphore,
            name,
            waiters,
            permits,
            pool: pool_size,
            hold,
        } = *self;
        let sampling = Arc::new(std::sync::atomic::AtomicBool::new(true));
        // On a thread and runtime of its own, so that its polls take no turn
        // of the waiters' worker threads.
        let sampler = {
            let (opts, queue, sampling) =
                (opts.clone(), format!("{name}#queue"), Arc::clone(&sampling));
            std::thread::spawn(move || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?
                    .block_on(sample_slots(opts, queue, sampling))
            })
        };
        let started = Instant::now();
        let tickets = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..waiters {
            let (semaphore, tickets) = (semaphore.clone(), Arc::clone(&tickets));
            tasks.spawn(async move {
                // The place in line: a ticket taken just before joining it, and
                // the moments just before and just after the call's first poll,
                // in which it joins the line. The thread can be preempted
                // between the ticket and the poll, so only the moments say
                // for sure that one waiter came before another.
                let ticket = tickets.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let arrived_from = Instant::now();
                let mut acquire = std::pin::pin!(semaphore.acquire(Duration::from_secs(120)));
                let first = std::future::poll_fn(|cx| Poll::Ready(acquire.as_mut().poll(cx))).await;
                let arrived_by = Instant::now();
                let permit = match first {
                    Poll::Ready(permit) => permit?,
                    Poll::Pending => acquire.await?,
                };
                let granted = Instant::now();
                tokio::time::sleep(hold).await;
                // Stops using it: held from `granted` to here, at most.
                let done = Instant::now();
                permit.release().await?;
                let arrived = Arrival {
                    ticket,
                    from: arrived_from,
                    by: arrived_by,
                };
                Ok::<_, distlock::Error>((arrived, granted, done, Instant::now()))
            });
            // Arrival order is the order of the first polls.
            tokio::task::yield_now().await;
        }
        let (mut spans, mut errors, mut first_error) = (Vec::new(), 0, None);
        while let Some(done) = tasks.join_next().await {
            match done? {
                Ok(span) => spans.push(span),
                Err(err) => {
                    errors += 1;
                    first_error.get_or_insert_with(|| err.to_string());
                }
            }
        }
        let took = started.elapsed();
        sampling.store(false, std::sync::atomic::Ordering::SeqCst);
        let samples = sampler
            .join()
            .map_err(|_| anyhow::anyhow!("the pg_locks sampler panicked"))??;
        let mut grants: Vec<Instant> = spans.iter().map(|s| s.1).collect();
        let mut releases: Vec<Instant> = spans.iter().map(|s| s.3).collect();
        grants.sort();
        releases.sort();
        let permits_n = permits as usize;
        let handoffs = releases
            .iter()
            .zip(grants.iter().skip(permits_n))
            .map(|(freed, granted)| granted.saturating_duration_since(*freed))
            .collect();
        // Most holders at once, from the time-stamps.
        let mut events: Vec<(Instant, i32)> =
            spans.iter().flat_map(|s| [(s.1, 1), (s.2, -1)]).collect();
        events.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(&b.1)));
        let (mut inside, mut most) = (0, 0);
        for (_, change) in events {
            inside += change;
            most = most.max(inside);
        }
        // While waiters queued: from the first grant to the last grant; and
        // after the ramp, from the permits-th grant to the last.
        let ramped = grants.get(permits_n.saturating_sub(1)).copied();
        let in_use_from = |from: Option<Instant>| match (from, grants.last()) {
            (Some(from), Some(last)) => in_use(&spans, from, *last, permits),
            _ => 0.0,
        };
        let utilisation = in_use_from(grants.first().copied());
        let utilisation_after_ramp = in_use_from(ramped);
        let server_taken = match (ramped, grants.last()) {
            (Some(from), Some(last)) => {
                let within: Vec<u32> = samples
                    .iter()
                    .filter(|(at, _)| *at >= from && *at <= *last)
                    .map(|(_, taken)| *taken)
                    .collect();
                f64::from(within.iter().sum::<u32>())
                    / (within.len() as f64 * f64::from(permits)).max(1e-9)
            }
            _ => 0.0,
        };
        let mut order: Vec<(Instant, usize)> = spans.iter().map(|s| (s.1, s.0.ticket)).collect();
        order.sort();
        let displaced = order
            .iter()
            .enumerate()
            .map(|(at, (_, i))| at.abs_diff(*i))
            .max()
            .unwrap_or(0);
        let overtaken = spans
            .iter()
            .map(|x| {
                spans
                    .iter()
                    .filter(|y| y.0.from > x.0.by && y.1 < x.1)
                    .count()
            })
            .max()
            .unwrap_or(0);
        Ok(SemaphoreScale {
            connections,
            waiters,
            permits,
            pool: pool_size,
            hold,
            handoff: Latencies::new(
                "Semaphore(10) at scale: a release to the grant it made room for",
                "the holder's release() returned",
                handoffs,
            ),
            most_holders: usize::try_from(most).unwrap_or(0),
            utilisation,
            utilisation_after_ramp,
            server_taken,
            ramp: ramped
                .zip(grants.first())
                .map_or(Duration::ZERO, |(to, from)| {
                    to.saturating_duration_since(*from)
                }),
            displaced,
            overtaken,
            errors,
            first_error,
            took,
        })
    }
}

/// Permit-time held between `from` and `last` over `permits` × that
/// interval; a span is `(arrival, granted, done using it, released)`.
fn in_use(
    spans: &[(Arrival, Instant, Instant, Instant)],
    from: Instant,
    last: Instant,
    permits: u32,
) -> f64 {
    let held: Duration = spans
        .iter()
        .map(|s| s.2.min(last).saturating_duration_since(s.1.max(from)))
        .sum();
    held.as_secs_f64()
        / (last.saturating_duration_since(from).as_secs_f64() * f64::from(permits)).max(1e-9)
}

/// Counts the semaphore's slots taken on the server every 5 ms, on a
/// connection outside the pool, until `sampling` turns false: each sample is
/// the moment its answer came and the count of exclusive advisory locks held
/// in the database other than the queue (`queue`: its name).
async fn sample_slots(
    opts: PgConnectOptions,
    queue: String,
    sampling: Arc<std::sync::atomic::AtomicBool>,
) -> anyhow::Result<Vec<(Instant, u32)>> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect_with(&opts).await?;
    let mut samples = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    while sampling.load(std::sync::atomic::Ordering::SeqCst) {
        tick.tick().await;
        let taken: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_catalog.pg_locks \
             WHERE locktype = 'advisory' AND granted AND mode = 'ExclusiveLock' \
             AND database = (SELECT oid FROM pg_catalog.pg_database \
                             WHERE datname = pg_catalog.current_database()) \
             AND objid::bigint <> pg_catalog.hashtext($1)::bigint & 4294967295",
        )
        .bind(&queue)
        .fetch_one(&mut conn)
        .await?;
        samples.push((Instant::now(), u32::try_from(taken).unwrap_or(u32::MAX)));
    }
    Ok(samples)
}

/// The report's table of [`semaphore_scale`].
pub fn scale_table(runs: &[SemaphoreScale]) -> String {
    let mut out = String::from(
        "\n### Semaphore at scale: many waiters on one pool\n\n\
         Furthest from arrival order: by ticket, the furthest a waiter was granted from \
         its ticket's place (a ticket is taken just before the call, and a thread preempted \
         in between joins the line late); overtaken, the most waiters that surely came \
         after one waiter (their call's first poll began after its first poll ended) and \
         were served before it. Connections: new, the pool's connections had run no \
         statement of the semaphore before the burst (a new backend reads the catalog and \
         plans each statement on first use); used, a burst ran on them before. The ramp: \
         from the first grant to the one that took the last free permit. After the ramp: \
         the permits in use from then to the last grant, and the semaphore's slots taken \
         on the server then (pg_locks, sampled every 5 ms).\n\n\
         | connections | waiters | permits | pool | hold | errors | most holders | permits in use while waiters queued | ramp ms | … after the ramp | slots taken on the server after the ramp | furthest from arrival order, by ticket | overtaken by later arrivals | hand-off p50 µs | p99 µs | max µs | took |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for run in runs {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} ms | {}{} | {} | {:.1}% | {:.1} | {:.1}% | {:.1}% | {} places | {} | {:.0} | {:.0} | {:.0} | {:.2} s |\n",
            run.connections,
            run.waiters,
            run.permits,
            run.pool,
            run.hold.as_millis(),
            run.errors,
            run.first_error
                .as_ref()
                .map(|e| format!(" (first: {e})"))
                .unwrap_or_default(),
            run.most_holders,
            run.utilisation * 100.0,
            run.ramp.as_secs_f64() * 1000.0,
            run.utilisation_after_ramp * 100.0,
            run.server_taken * 100.0,
            run.displaced,
            run.overtaken,
            run.handoff.at(0.5),
            run.handoff.at(0.99),
            run.handoff.at(1.0),
            run.took.as_secs_f64(),
        ));
    }
    out
}

/// The report's table.
pub fn table(rows: &[Latencies]) -> String {
    let mut out = String::from(
        "\n### Lock kinds: hand-over latencies\n\n\
         | what | measured from | trials | p50 µs | p99 µs | max µs |\n\
         |---|---|---:|---:|---:|---:|\n",
    );
    for row in rows {
        out.push_str(&format!(
            "| {} | {} | {} | {:.0} | {:.0} | {:.0} |\n",
            row.what,
            row.from,
            row.sorted_us.len(),
            row.at(0.5),
            row.at(0.99),
            row.at(1.0)
        ));
    }
    out
}
