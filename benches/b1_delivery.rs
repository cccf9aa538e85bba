//! B1: deliveries per second with three no-op handlers.
//!
//! Three contenders, measured in one run on the same machine:
//! - `dacapo`: the runtime, publishing through the in-process transport (inbox, supervisor,
//!   context actor, three handler actors, aggregate, settle);
//! - `actix skeleton`: the same actor spawns and nothing else (a supervisor and three handler
//!   actors per delivery, on the same number of worker arbiters, with the same in-flight bound);
//! - `tokio mpsc+oneshot`: a dispatcher task over a bounded channel spawning three tasks per
//!   delivery and awaiting their oneshot replies.
//!
//! Run with `cargo bench --bench b1_delivery` (optionally `-- DELIVERIES`). The goal is a ratio
//! of at least 0.6 against the actix skeleton.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use actix::prelude::*;
use dacapo::prelude::*;
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, Semaphore, mpsc, oneshot};

const WORKERS: usize = 2;
const IN_FLIGHT: usize = 1024;

#[derive(Serialize, Deserialize)]
struct Ping {
    n: u64,
}

impl dacapo::Message for Ping {
    const TYPE: &'static str = "bench.ping";
}

struct Noop;

impl dacapo::Handler<Ping> for Noop {
    async fn handle(&self, _: &Ping, _: &MessageContext) -> Result<(), HandlerError> {
        Ok(())
    }
}

fn dacapo_run(deliveries: u64) -> Duration {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let runtime = Runtime::builder()
            .workers(WORKERS)
            .max_in_flight(IN_FLIGHT)
            .module(
                Module::new("bench")
                    .handle_named::<Ping, _>("a", Noop)
                    .handle_named::<Ping, _>("b", Noop)
                    .handle_named::<Ping, _>("c", Noop),
            )
            .build()
            .unwrap();
        let start = Instant::now();
        for n in 0..deliveries {
            runtime.publish(&Ping { n }).await.unwrap();
        }
        runtime.idle().await;
        let elapsed = start.elapsed();
        assert_eq!(runtime.stats().handled, deliveries);
        runtime.shutdown().await;
        elapsed
    })
}

// --- actix skeleton -------------------------------------------------------------------------

struct Done;
impl actix::Message for Done {
    type Result = ();
}

struct Finish {
    done: Arc<AtomicUsize>,
    target: usize,
    all_done: Arc<Notify>,
    permits: Arc<Semaphore>,
}

struct SkeletonSupervisor {
    pending: usize,
    finish: Arc<Finish>,
}

impl Actor for SkeletonSupervisor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        for _ in 0..3 {
            SkeletonHandler {
                supervisor: ctx.address().recipient(),
            }
            .start();
        }
    }
}

impl actix::Handler<Done> for SkeletonSupervisor {
    type Result = ();

    fn handle(&mut self, _: Done, ctx: &mut Context<Self>) {
        self.pending -= 1;
        if self.pending == 0 {
            self.finish.permits.add_permits(1);
            if self.finish.done.fetch_add(1, Ordering::Relaxed) + 1 == self.finish.target {
                self.finish.all_done.notify_one();
            }
            ctx.stop();
        }
    }
}

struct SkeletonHandler {
    supervisor: Recipient<Done>,
}

impl Actor for SkeletonHandler {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let noop = async {};
        ctx.spawn(noop.into_actor(self).map(|(), actor, ctx| {
            actor.supervisor.do_send(Done);
            ctx.stop();
        }));
    }
}

fn actix_run(deliveries: u64) -> Duration {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let system = System::new();
        let arbiters: Vec<Arbiter> = (0..WORKERS).map(|_| Arbiter::new()).collect();
        let handles: Vec<ArbiterHandle> = arbiters.iter().map(Arbiter::handle).collect();
        let elapsed = system.block_on(async move {
            let finish = Arc::new(Finish {
                done: Arc::default(),
                target: deliveries as usize,
                all_done: Arc::default(),
                permits: Arc::new(Semaphore::new(IN_FLIGHT)),
            });
            let start = Instant::now();
            for n in 0..deliveries as usize {
                finish.permits.acquire().await.unwrap().forget();
                let finish = Arc::clone(&finish);
                SkeletonSupervisor::start_in_arbiter(&handles[n % WORKERS], move |_| {
                    SkeletonSupervisor { pending: 3, finish }
                });
            }
            finish.all_done.notified().await;
            start.elapsed()
        });
        for arbiter in arbiters {
            arbiter.stop();
            arbiter.join().unwrap();
        }
        tx.send(elapsed).unwrap();
    });
    rx.recv().unwrap()
}

// --- raw tokio ------------------------------------------------------------------------------

fn tokio_run(deliveries: u64) -> Duration {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKERS)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (tx, mut rx) = mpsc::channel::<u64>(IN_FLIGHT);
        let done = Arc::new(AtomicUsize::new(0));
        let all_done = Arc::new(Notify::new());
        let target = deliveries as usize;
        let dispatcher = {
            let (done, all_done) = (Arc::clone(&done), Arc::clone(&all_done));
            tokio::spawn(async move {
                let permits = Arc::new(Semaphore::new(IN_FLIGHT));
                while let Some(_n) = rx.recv().await {
                    let permit = Arc::clone(&permits).acquire_owned().await.unwrap();
                    let (done, all_done) = (Arc::clone(&done), Arc::clone(&all_done));
                    tokio::spawn(async move {
                        let replies: Vec<oneshot::Receiver<()>> = (0..3)
                            .map(|_| {
                                let (reply, receiver) = oneshot::channel();
                                tokio::spawn(async move {
                                    let _ = reply.send(());
                                });
                                receiver
                            })
                            .collect();
                        for reply in replies {
                            reply.await.unwrap();
                        }
                        drop(permit);
                        if done.fetch_add(1, Ordering::Relaxed) + 1 == target {
                            all_done.notify_one();
                        }
                    });
                }
            })
        };
        let start = Instant::now();
        for n in 0..deliveries {
            tx.send(n).await.unwrap();
        }
        all_done.notified().await;
        let elapsed = start.elapsed();
        drop(tx);
        dispatcher.await.unwrap();
        elapsed
    })
}

/// Runs that many deliveries and says how long they took.
type Contender = fn(u64) -> Duration;

fn rate(deliveries: u64, elapsed: Duration) -> f64 {
    deliveries as f64 / elapsed.as_secs_f64()
}

fn median(mut rates: Vec<f64>) -> f64 {
    rates.sort_by(f64::total_cmp);
    rates[rates.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let deliveries: u64 = args.iter().find_map(|a| a.parse().ok()).unwrap_or(100_000);
    let contenders: [(&str, Contender); 3] = [
        ("dacapo", dacapo_run),
        ("actix skeleton", actix_run),
        ("tokio mpsc+oneshot", tokio_run),
    ];
    // `-- dacapo` (or `actix`, `tokio`) measures one contender alone, for a profiler.
    if let Some((name, run)) = contenders
        .iter()
        .find(|(name, _)| args.iter().any(|a| name.starts_with(a.as_str())))
    {
        println!(
            "{name} {:.0} deliveries/s",
            rate(deliveries, run(deliveries))
        );
        return;
    }
    // Two cores shared by several threads make single runs noisy: interleave rounds of every
    // contender and compare medians.
    const ROUNDS: usize = 5;
    for (_, run) in &contenders {
        run(deliveries / 10);
    }
    let mut rates = vec![Vec::new(); contenders.len()];
    for _ in 0..ROUNDS {
        for (i, (_, run)) in contenders.iter().enumerate() {
            rates[i].push(rate(deliveries, run(deliveries)));
        }
    }
    let medians: Vec<f64> = rates.into_iter().map(median).collect();
    println!(
        "B1: {deliveries} deliveries, 3 no-op handlers each, {WORKERS} workers, {IN_FLIGHT} in flight, median of {ROUNDS} rounds"
    );
    for ((name, _), median) in contenders.iter().zip(&medians) {
        println!("  {name:<20} {median:>12.0} deliveries/s");
    }
    println!(
        "  dacapo / actix skeleton = {:.2} (goal >= 0.60)",
        medians[0] / medians[1]
    );
    println!("  dacapo / tokio          = {:.2}", medians[0] / medians[2]);
}
