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
//! - A stop request cancels pending restarts and stops the children tier by tier, lowest
//!   first ([`Supervisor::with_tiers`]; `tessera up` puts coordinators before shards, so
//!   that coordinators drain their requests while the shards still run them): SIGTERM to
//!   each running child of the tier (to its process group); those still running after the
//!   grace period are killed (SIGKILL); once the tier is gone, the next one's turn comes.
//!   A second stop request kills every child at once. Once every child is gone the
//!   launcher exits.

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
    /// Its turn when stopping: lower tiers stop first.
    tier: u32,
    /// The delay before the next restart.
    backoff: Duration,
    restarts: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Children run and are restarted when they exit.
    Running,
    /// A stop was requested: `tier`'s children got SIGTERM and have until `deadline`;
    /// `killed` once SIGKILL went out to them.
    Stopping {
        tier: u32,
        deadline: Instant,
        killed: bool,
    },
    /// A second stop request: SIGKILL went out to every child.
    Killing,
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
            tier: 0,
            backoff: policy.first_backoff,
            restarts: 0,
        };
        Supervisor {
            policy,
            children: vec![child; children],
            phase: Phase::Running,
        }
    }

    /// The same, stopping child `i` in turn `tiers[i]` (lower first) rather than all at
    /// once.
    pub fn with_tiers(mut self, tiers: &[u32]) -> Supervisor {
        assert_eq!(tiers.len(), self.children.len(), "one tier per child");
        for (child, &tier) in self.children.iter_mut().zip(tiers) {
            child.tier = tier;
        }
        self
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
            Phase::Stopping {
                deadline, killed, ..
            } => (!killed).then_some(deadline),
            Phase::Killing => None,
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
            Phase::Stopping { .. } | Phase::Killing => {
                child.state = ChildState::Gone;
                let mut actions = vec![Action::Note(Note::Stopped {
                    child: id,
                    termination,
                })];
                if self.running().next().is_none() {
                    actions.push(Action::Exit);
                } else if let Phase::Stopping { tier, .. } = self.phase
                    && !self.running().any(|c| self.children[c.0].tier == tier)
                {
                    actions.extend(self.stop_next_tier(now));
                }
                actions
            }
        }
    }

    /// SIGTERM to the running children of the lowest tier that has any.
    fn stop_next_tier(&mut self, now: Instant) -> Vec<Action> {
        let Some(tier) = self.running().map(|c| self.children[c.0].tier).min() else {
            return vec![Action::Exit];
        };
        self.phase = Phase::Stopping {
            tier,
            deadline: now + self.policy.grace,
            killed: false,
        };
        let running: Vec<ChildId> = self
            .running()
            .filter(|c| self.children[c.0].tier == tier)
            .collect();
        let mut actions = vec![Action::Note(Note::Stopping {
            running: running.len(),
            grace: self.policy.grace,
        })];
        actions.extend(running.into_iter().map(Action::Terminate));
        actions
    }

    fn stop(&mut self, now: Instant) -> Vec<Action> {
        match self.phase {
            Phase::Running => {
                for child in &mut self.children {
                    if let ChildState::Waiting { .. } = child.state {
                        child.state = ChildState::Gone;
                    }
                }
                self.stop_next_tier(now)
            }
            Phase::Stopping { tier, killed, .. } => {
                self.phase = Phase::Killing;
                // Not again to a tier that got SIGKILL already.
                let children = &self.children;
                let left: Vec<ChildId> = self
                    .running()
                    .filter(|c| !(killed && children[c.0].tier == tier))
                    .collect();
                if left.is_empty() {
                    return Vec::new();
                }
                let mut actions = vec![Action::Note(Note::KillNow { left: left.len() })];
                actions.extend(left.into_iter().map(Action::Kill));
                actions
            }
            Phase::Killing => Vec::new(),
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
            Phase::Stopping {
                tier,
                deadline,
                killed,
            } => {
                if killed || now < deadline {
                    return Vec::new();
                }
                self.phase = Phase::Stopping {
                    tier,
                    deadline,
                    killed: true,
                };
                let children = &self.children;
                let in_tier = |c: ChildId| children[c.0].tier == tier;
                let running: Vec<ChildId> = self.running().filter(|&c| in_tier(c)).collect();
                let mut actions = vec![Action::Note(Note::GraceOver {
                    left: running.len(),
                })];
                actions.extend(running.into_iter().map(Action::Kill));
                actions
            }
            Phase::Killing => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests;
