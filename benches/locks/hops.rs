//! What a hop between tasks costs on this machine: the price of distlock's
//! background task per lock (one spawn when a lock is taken, one
//! request/reply when it is released), measured without a database.

use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use crate::stats::{summarize, us};

/// Medians in µs: a request/reply to a waiting task, and a spawn + join.
#[derive(Debug, Clone, Copy)]
pub struct Hops {
    pub request_reply: f64,
    pub spawn_join: f64,
}

pub async fn measure(samples: usize) -> Hops {
    // A long-lived task answering requests, as a keeper answers `release()`.
    let (tx, mut rx) = mpsc::unbounded_channel::<oneshot::Sender<()>>();
    let server = tokio::spawn(async move {
        while let Some(reply) = rx.recv().await {
            let _ = reply.send(());
        }
    });
    let mut request_reply = Vec::with_capacity(samples);
    for _ in 0..samples {
        let t = Instant::now();
        let (reply, answer) = oneshot::channel();
        if tx.send(reply).is_err() || answer.await.is_err() {
            break;
        }
        request_reply.push(t.elapsed());
        // Let the other task park again, as a keeper does between calls.
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    drop(tx);
    let _ = server.await;
    let mut spawn_join = Vec::with_capacity(samples);
    for _ in 0..samples {
        let t = Instant::now();
        let _ = tokio::spawn(async {}).await;
        spawn_join.push(t.elapsed());
    }
    Hops {
        request_reply: us(summarize(&mut request_reply).p50),
        spawn_join: us(summarize(&mut spawn_join).p50),
    }
}
