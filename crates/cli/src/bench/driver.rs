//! Sends the workload: a closed loop (`--concurrency`: that many workers, each sending its
//! next request as soon as the last one ends) or an open loop (`--rate`: Poisson arrivals on
//! a schedule fixed by the seed, handed to at most `--max-concurrency` workers; an arrival
//! with no free worker waits, and later arrivals keep their scheduled times).
//!
//! Warmup requests run first, as a closed loop, and the measured phase starts when they
//! have all ended: its wall time runs from then until its last request ends.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::args::{BenchConfig, LoadMode, StopRule};
use super::client::{Client, Outcome};
use super::workload::Workload;

/// The random stream of arrival times (request `i` uses stream `i`).
const ARRIVAL_STREAM: u64 = u64::MAX;

/// The outcomes of the measured phase.
#[derive(Debug)]
pub struct RunResult {
    pub outcomes: Vec<Outcome>,
    pub wall: Duration,
    /// Warmup requests that failed (their timings are never counted).
    pub warmup_failed: usize,
}

/// Runs the warmup, then the measured phase; `on_done` sees every measured outcome as it
/// comes (for the progress bar).
pub fn run(
    client: &Client,
    workload: &Workload,
    config: &BenchConfig,
    on_done: &(dyn Fn(&Outcome) + Sync),
) -> RunResult {
    let mut warmup_failed = 0;
    if config.warmup > 0 {
        let concurrency = config.mode.max_in_flight().min(config.warmup as usize);
        let stop = StopRule {
            requests: Some(config.warmup),
            duration: None,
        };
        let (outcomes, _) = closed_loop(client, workload, 0, stop, concurrency, &|_| {});
        warmup_failed = outcomes.iter().filter(|o| o.is_err()).count();
    }
    let first = config.warmup;
    let (outcomes, wall) = match config.mode {
        LoadMode::Closed { concurrency } => {
            closed_loop(client, workload, first, config.stop, concurrency, on_done)
        }
        LoadMode::Open {
            rate,
            max_concurrency,
        } => {
            let gaps = arrival_gaps(config.seed, rate);
            open_loop(
                client,
                workload,
                first,
                config.stop,
                max_concurrency,
                gaps,
                on_done,
            )
        }
    };
    RunResult {
        outcomes,
        wall,
        warmup_failed,
    }
}

/// `concurrency` workers; requests `first`, `first + 1`, … until `stop`.
fn closed_loop(
    client: &Client,
    workload: &Workload,
    first: u64,
    stop: StopRule,
    concurrency: usize,
    on_done: &(dyn Fn(&Outcome) + Sync),
) -> (Vec<Outcome>, Duration) {
    let next = AtomicU64::new(0);
    let started = Instant::now();
    let deadline = stop.duration.map(|d| started + d);
    let outcomes = thread::scope(|scope| {
        let workers: Vec<_> = (0..concurrency)
            .map(|_| {
                scope.spawn(|| {
                    let mut outcomes = Vec::new();
                    loop {
                        if deadline.is_some_and(|d| Instant::now() >= d) {
                            break;
                        }
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if stop.requests.is_some_and(|n| i >= n) {
                            break;
                        }
                        let outcome = client.send(&workload.request(first + i));
                        on_done(&outcome);
                        outcomes.push(outcome);
                    }
                    outcomes
                })
            })
            .collect();
        join_all(workers)
    });
    (outcomes, started.elapsed())
}

/// Requests sent at the times `gaps` lay out, by at most `max_concurrency` workers.
fn open_loop(
    client: &Client,
    workload: &Workload,
    first: u64,
    stop: StopRule,
    max_concurrency: usize,
    mut gaps: impl Iterator<Item = Duration>,
    on_done: &(dyn Fn(&Outcome) + Sync),
) -> (Vec<Outcome>, Duration) {
    // A rendezvous channel: a send completes only when a worker is free to take it.
    let (sender, receiver) = mpsc::sync_channel::<u64>(0);
    let receiver = Mutex::new(receiver);
    let started = Instant::now();
    let deadline = stop.duration.map(|d| started + d);
    let outcomes = thread::scope(|scope| {
        let workers: Vec<_> = (0..max_concurrency)
            .map(|_| {
                scope.spawn(|| {
                    let mut outcomes = Vec::new();
                    loop {
                        let next = receiver
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .recv();
                        let Ok(i) = next else { break };
                        let outcome = client.send(&workload.request(first + i));
                        on_done(&outcome);
                        outcomes.push(outcome);
                    }
                    outcomes
                })
            })
            .collect();
        let mut at = started;
        for i in 0.. {
            if stop.requests.is_some_and(|n| i >= n) {
                break;
            }
            at += gaps.next().unwrap_or_default();
            if deadline.is_some_and(|d| at >= d) {
                break;
            }
            thread::sleep(at.saturating_duration_since(Instant::now()));
            if sender.send(i).is_err() {
                break; // Every worker is gone: nothing more can be sent.
            }
        }
        drop(sender);
        join_all(workers)
    });
    (outcomes, started.elapsed())
}

fn join_all(workers: Vec<thread::ScopedJoinHandle<'_, Vec<Outcome>>>) -> Vec<Outcome> {
    let mut outcomes = Vec::new();
    for worker in workers {
        match worker.join() {
            Ok(mut part) => outcomes.append(&mut part),
            // A worker never panics on a server's answer; a panic is a bug, shown as such.
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
    outcomes
}

/// The gaps between Poisson arrivals at `rate` per second: exponential, mean `1 / rate`,
/// from the seed's arrival stream.
pub fn arrival_gaps(seed: u64, rate: f64) -> impl Iterator<Item = Duration> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(ARRIVAL_STREAM);
    std::iter::repeat_with(move || {
        // 1 − u is in (0, 1]: its logarithm is finite.
        let u: f64 = rng.random();
        Duration::from_secs_f64(-(1.0 - u).ln() / rate)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrivals_are_seeded_with_the_asked_mean() {
        let gaps: Vec<Duration> = arrival_gaps(3, 4.0).take(4000).collect();
        assert_eq!(gaps, arrival_gaps(3, 4.0).take(4000).collect::<Vec<_>>());
        assert_ne!(
            gaps[..10],
            arrival_gaps(4, 4.0).take(10).collect::<Vec<_>>()[..]
        );
        let mean = gaps.iter().map(Duration::as_secs_f64).sum::<f64>() / gaps.len() as f64;
        // Mean 0.25 s; the standard error of 4000 exponential draws is 0.25 / √4000 ≈ 0.004.
        assert!((mean - 0.25).abs() < 0.02, "mean gap {mean}");
        // Exponential: about e⁻¹ of the gaps exceed the mean.
        let above = gaps.iter().filter(|g| g.as_secs_f64() > 0.25).count() as f64 / 4000.0;
        assert!(
            (above - (-1.0f64).exp()).abs() < 0.03,
            "share above the mean {above}"
        );
    }
}
