//! The launcher's decisions, without I/O: when to start, restart, terminate and kill each
//! child process, and when the launcher may exit. It reads no clock (every event comes with
//! `now`) and touches no process; the driver (`driver.rs`) turns its [`Action`]s into
//! `spawn`, `killpg` and log lines, and feeds back what happened as [`Event`]s.
//!
//! Rules:
//! - A child that exits while the launcher is running was not asked to: it is restarted
//!   after a backoff of 1 s, doubled after each restart up to 10 s, and back to 1 s once a
//!   run lasted 30 s (a child that crashes at start does not spin; one that crashes once a
//!   day restarts at once).
//! - A stop request terminates every running child (SIGTERM to its process group) and
//!   cancels pending restarts; children still running after the grace period are killed
//!   (SIGKILL). A second stop request kills at once. Once every child is gone the launcher
//!   exits.

use std::fmt;
use std::time::{Duration, Instant};

/// A child process of the launcher, by its index in the launcher's list.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChildId(pub usize);

/// How a child process ended, as the operating system reported it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Termination {
    /// It exited with this code.
    Code(i32),
    /// A signal ended it.
    Signal(i32),
    /// It could not be started at all (the driver logged why).
    NotStarted,
}

impl fmt::Display for Termination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Termination::Code(code) => write!(f, "exit code {code}"),
            Termination::Signal(signal) => match nix::sys::signal::Signal::try_from(signal) {
                Ok(name) => write!(f, "killed by {name}"),
                Err(_) => write!(f, "killed by signal {signal}"),
            },
            Termination::NotStarted => f.write_str("could not start"),
        }
    }
}

/// Timings of restarts and stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    /// The delay before the first restart, and after a run of at least `reset_after`.
    pub first_backoff: Duration,
    /// The longest delay between restarts.
    pub max_backoff: Duration,
    /// A run at least this long resets the backoff.
    pub reset_after: Duration,
    /// How long children have after SIGTERM before SIGKILL.
    pub grace: Duration,
}

impl Policy {
    /// 1 s doubling to 10 s, reset after 30 s of running; `grace` as given.
    pub fn with_grace(grace: Duration) -> Policy {
        Policy {
            first_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(10),
            reset_after: Duration::from_secs(30),
            grace,
        }
    }
}

/// What happened, as the driver saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// A child ended (or its spawn failed: [`Termination::NotStarted`]).
    Exited {
        child: ChildId,
        termination: Termination,
    },
    /// Ctrl-C, SIGTERM or SIGHUP reached the launcher.
    StopRequested,
    /// Time passed: due restarts and the end of the grace period are acted on.
    Tick,
}

/// What the driver should do, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Start the child (in a new process group). If that fails, report
    /// [`Event::Exited`] with [`Termination::NotStarted`].
    Spawn(ChildId),
    /// SIGTERM to the child's process group.
    Terminate(ChildId),
    /// SIGKILL to the child's process group.
    Kill(ChildId),
    /// Tell the user.
    Note(Note),
    /// Every child is gone after a stop request: the launcher may exit.
    Exit,
}

/// Something worth a log line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Note {
    /// A child ended without being asked to; it starts again after `restart_in`.
    Crashed {
        child: ChildId,
        termination: Termination,
        ran: Duration,
        restart_in: Duration,
        /// Restarts so far, this one included.
        restarts: u32,
    },
    /// A child ended after the stop request.
    Stopped {
        child: ChildId,
        termination: Termination,
    },
    /// Stopping: SIGTERM sent to `running` children, who have `grace`.
    Stopping { running: usize, grace: Duration },
    /// The grace period ended with `left` children still running; they are killed.
    GraceOver { left: usize },
    /// A second stop request: the `left` children still running are killed now.
    KillNow { left: usize },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ChildState {
    Running {
        since: Instant,
    },
    /// Waiting to be restarted.
    Waiting {
        until: Instant,
    },
    Gone,
}

#[derive(Clone, Copy, Debug)]
struct Child {
    state: ChildState,
    /// The delay before the next restart.
    backoff: Duration,
    restarts: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Children run and are restarted when they exit.
    Running,
    /// A stop was requested; `killed` once SIGKILL went out.
    Stopping { deadline: Instant, killed: bool },
}

/// The launcher's state machine (see the module docs for its rules).
#[derive(Debug)]
pub struct Supervisor {
    policy: Policy,
    children: Vec<Child>,
    phase: Phase,
}

impl Supervisor {
    /// A supervisor of `children` processes, none started yet.
    pub fn new(children: usize, policy: Policy) -> Supervisor {
        let child = Child {
            state: ChildState::Gone,
            backoff: policy.first_backoff,
            restarts: 0,
        };
        Supervisor {
            policy,
            children: vec![child; children],
            phase: Phase::Running,
        }
    }

    /// Starts every child.
    pub fn start(&mut self, now: Instant) -> Vec<Action> {
        (0..self.children.len())
            .map(|i| self.spawn(ChildId(i), now))
            .collect()
    }

    /// Decides what to do about `event`.
    pub fn handle(&mut self, event: Event, now: Instant) -> Vec<Action> {
        match event {
            Event::Exited { child, termination } => self.exited(child, termination, now),
            Event::StopRequested => self.stop(now),
            Event::Tick => self.tick(now),
        }
    }

    /// When the next [`Event::Tick`] has something to do, if ever.
    pub fn next_wakeup(&self) -> Option<Instant> {
        match self.phase {
            Phase::Running => self
                .children
                .iter()
                .filter_map(|c| match c.state {
                    ChildState::Waiting { until } => Some(until),
                    _ => None,
                })
                .min(),
            Phase::Stopping { deadline, killed } => (!killed).then_some(deadline),
        }
    }

    fn spawn(&mut self, child: ChildId, now: Instant) -> Action {
        self.children[child.0].state = ChildState::Running { since: now };
        Action::Spawn(child)
    }

    fn running(&self) -> impl Iterator<Item = ChildId> + '_ {
        self.children
            .iter()
            .enumerate()
            .filter(|(_, c)| matches!(c.state, ChildState::Running { .. }))
            .map(|(i, _)| ChildId(i))
    }

    fn exited(&mut self, id: ChildId, termination: Termination, now: Instant) -> Vec<Action> {
        let Some(child) = self.children.get_mut(id.0) else {
            return Vec::new();
        };
        let ChildState::Running { since } = child.state else {
            // Not ours to act on (already reported).
            return Vec::new();
        };
        match self.phase {
            Phase::Running => {
                let ran = now.saturating_duration_since(since);
                if ran >= self.policy.reset_after {
                    child.backoff = self.policy.first_backoff;
                }
                let restart_in = child.backoff;
                child.backoff = (child.backoff * 2).min(self.policy.max_backoff);
                child.restarts += 1;
                child.state = ChildState::Waiting {
                    until: now + restart_in,
                };
                vec![Action::Note(Note::Crashed {
                    child: id,
                    termination,
                    ran,
                    restart_in,
                    restarts: child.restarts,
                })]
            }
            Phase::Stopping { .. } => {
                child.state = ChildState::Gone;
                let mut actions = vec![Action::Note(Note::Stopped {
                    child: id,
                    termination,
                })];
                if self.running().next().is_none() {
                    actions.push(Action::Exit);
                }
                actions
            }
        }
    }

    fn stop(&mut self, now: Instant) -> Vec<Action> {
        match self.phase {
            Phase::Running => {
                for child in &mut self.children {
                    if let ChildState::Waiting { .. } = child.state {
                        child.state = ChildState::Gone;
                    }
                }
                self.phase = Phase::Stopping {
                    deadline: now + self.policy.grace,
                    killed: false,
                };
                let running: Vec<ChildId> = self.running().collect();
                if running.is_empty() {
                    return vec![Action::Exit];
                }
                let mut actions = vec![Action::Note(Note::Stopping {
                    running: running.len(),
                    grace: self.policy.grace,
                })];
                actions.extend(running.into_iter().map(Action::Terminate));
                actions
            }
            Phase::Stopping { deadline, killed } => {
                if killed {
                    return Vec::new();
                }
                self.phase = Phase::Stopping {
                    deadline,
                    killed: true,
                };
                self.kill_all(|left| Note::KillNow { left })
            }
        }
    }

    fn tick(&mut self, now: Instant) -> Vec<Action> {
        match self.phase {
            Phase::Running => {
                let due: Vec<ChildId> = self
                    .children
                    .iter()
                    .enumerate()
                    .filter(
                        |(_, c)| matches!(c.state, ChildState::Waiting { until } if until <= now),
                    )
                    .map(|(i, _)| ChildId(i))
                    .collect();
                due.into_iter().map(|c| self.spawn(c, now)).collect()
            }
            Phase::Stopping { deadline, killed } => {
                if killed || now < deadline {
                    return Vec::new();
                }
                self.phase = Phase::Stopping {
                    deadline,
                    killed: true,
                };
                self.kill_all(|left| Note::GraceOver { left })
            }
        }
    }

    fn kill_all(&self, note: fn(usize) -> Note) -> Vec<Action> {
        let running: Vec<ChildId> = self.running().collect();
        let mut actions = vec![Action::Note(note(running.len()))];
        actions.extend(running.into_iter().map(Action::Kill));
        actions
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CRASH: Termination = Termination::Code(1);

    fn policy() -> Policy {
        Policy::with_grace(Duration::from_secs(10))
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn exited(child: usize) -> Event {
        Event::Exited {
            child: ChildId(child),
            termination: CRASH,
        }
    }

    /// The restart delay announced by `actions`, which must hold one crash note.
    fn restart_in(actions: &[Action]) -> Duration {
        match actions {
            [Action::Note(Note::Crashed { restart_in, .. })] => *restart_in,
            other => panic!("expected one crash note, got {other:?}"),
        }
    }

    #[test]
    fn start_spawns_every_child() {
        let mut sup = Supervisor::new(3, policy());
        let actions = sup.start(Instant::now());
        assert_eq!(
            actions,
            vec![
                Action::Spawn(ChildId(0)),
                Action::Spawn(ChildId(1)),
                Action::Spawn(ChildId(2))
            ]
        );
        assert_eq!(sup.next_wakeup(), None);
    }

    #[test]
    fn a_crash_restarts_after_a_doubling_backoff_capped_at_ten_seconds() {
        let t0 = Instant::now();
        let mut sup = Supervisor::new(2, policy());
        sup.start(t0);
        let mut now = t0;
        let mut delays = Vec::new();
        for _ in 0..6 {
            now += secs(1);
            let delay = restart_in(&sup.handle(exited(1), now));
            delays.push(delay.as_secs());
            // Nothing happens before the delay is over.
            assert_eq!(sup.next_wakeup(), Some(now + delay));
            assert!(
                sup.handle(Event::Tick, now + delay - Duration::from_millis(1))
                    .is_empty()
            );
            now += delay;
            assert_eq!(
                sup.handle(Event::Tick, now),
                vec![Action::Spawn(ChildId(1))]
            );
        }
        assert_eq!(delays, [1, 2, 4, 8, 10, 10]);
    }

    #[test]
    fn a_long_run_resets_the_backoff() {
        let t0 = Instant::now();
        let mut sup = Supervisor::new(1, policy());
        sup.start(t0);
        assert_eq!(restart_in(&sup.handle(exited(0), t0 + secs(1))), secs(1));
        sup.handle(Event::Tick, t0 + secs(2));
        assert_eq!(restart_in(&sup.handle(exited(0), t0 + secs(3))), secs(2));
        sup.handle(Event::Tick, t0 + secs(5));
        // This run lasts 30 s: the next delay is the first one again.
        assert_eq!(restart_in(&sup.handle(exited(0), t0 + secs(35))), secs(1));
    }

    #[test]
    fn the_crash_note_says_what_happened() {
        let t0 = Instant::now();
        let mut sup = Supervisor::new(1, policy());
        sup.start(t0);
        let killed = Termination::Signal(9);
        let actions = sup.handle(
            Event::Exited {
                child: ChildId(0),
                termination: killed,
            },
            t0 + secs(4),
        );
        assert_eq!(
            actions,
            vec![Action::Note(Note::Crashed {
                child: ChildId(0),
                termination: killed,
                ran: secs(4),
                restart_in: secs(1),
                restarts: 1,
            })]
        );
        assert_eq!(killed.to_string(), "killed by SIGKILL");
        assert_eq!(CRASH.to_string(), "exit code 1");
    }

    #[test]
    fn a_failed_spawn_is_retried_like_a_crash() {
        let t0 = Instant::now();
        let mut sup = Supervisor::new(1, policy());
        sup.start(t0);
        let event = Event::Exited {
            child: ChildId(0),
            termination: Termination::NotStarted,
        };
        assert_eq!(restart_in(&sup.handle(event, t0)), secs(1));
        assert_eq!(
            sup.handle(Event::Tick, t0 + secs(1)),
            vec![Action::Spawn(ChildId(0))]
        );
    }

    #[test]
    fn stop_terminates_running_children_and_cancels_restarts() {
        let t0 = Instant::now();
        let mut sup = Supervisor::new(3, policy());
        sup.start(t0);
        sup.handle(exited(1), t0 + secs(1));
        let actions = sup.handle(Event::StopRequested, t0 + secs(1));
        assert_eq!(
            actions,
            vec![
                Action::Note(Note::Stopping {
                    running: 2,
                    grace: secs(10)
                }),
                Action::Terminate(ChildId(0)),
                Action::Terminate(ChildId(2)),
            ]
        );
        assert_eq!(sup.next_wakeup(), Some(t0 + secs(11)));
        // The cancelled restart does not happen.
        assert!(sup.handle(Event::Tick, t0 + secs(5)).is_empty());
        let stopped = |child| {
            Action::Note(Note::Stopped {
                child: ChildId(child),
                termination: Termination::Code(0),
            })
        };
        let exit = |child| Event::Exited {
            child: ChildId(child),
            termination: Termination::Code(0),
        };
        assert_eq!(sup.handle(exit(0), t0 + secs(2)), vec![stopped(0)]);
        assert_eq!(
            sup.handle(exit(2), t0 + secs(3)),
            vec![stopped(2), Action::Exit]
        );
    }

    #[test]
    fn children_left_after_the_grace_period_are_killed() {
        let t0 = Instant::now();
        let mut sup = Supervisor::new(2, policy());
        sup.start(t0);
        sup.handle(Event::StopRequested, t0);
        assert_eq!(sup.next_wakeup(), Some(t0 + secs(10)));
        sup.handle(exited(0), t0 + secs(1));
        assert!(sup.handle(Event::Tick, t0 + secs(9)).is_empty());
        assert_eq!(
            sup.handle(Event::Tick, t0 + secs(10)),
            vec![
                Action::Note(Note::GraceOver { left: 1 }),
                Action::Kill(ChildId(1))
            ]
        );
        assert_eq!(sup.next_wakeup(), None);
        // Killed once only.
        assert!(sup.handle(Event::Tick, t0 + secs(11)).is_empty());
        assert!(sup.handle(Event::StopRequested, t0 + secs(11)).is_empty());
        let actions = sup.handle(exited(1), t0 + secs(11));
        assert_eq!(actions.last(), Some(&Action::Exit));
    }

    #[test]
    fn a_second_stop_request_kills_at_once() {
        let t0 = Instant::now();
        let mut sup = Supervisor::new(2, policy());
        sup.start(t0);
        sup.handle(Event::StopRequested, t0);
        assert_eq!(
            sup.handle(Event::StopRequested, t0 + secs(1)),
            vec![
                Action::Note(Note::KillNow { left: 2 }),
                Action::Kill(ChildId(0)),
                Action::Kill(ChildId(1))
            ]
        );
    }

    #[test]
    fn stop_with_nothing_running_exits_at_once() {
        let t0 = Instant::now();
        let mut sup = Supervisor::new(1, policy());
        sup.start(t0);
        sup.handle(exited(0), t0);
        assert_eq!(sup.handle(Event::StopRequested, t0), vec![Action::Exit]);
    }

    #[test]
    fn a_repeated_exit_report_is_ignored() {
        let t0 = Instant::now();
        let mut sup = Supervisor::new(1, policy());
        sup.start(t0);
        sup.handle(exited(0), t0);
        assert!(sup.handle(exited(0), t0).is_empty());
        assert!(sup.handle(exited(7), t0).is_empty());
    }
}
