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

/// Coordinators (tier 0) stop before shards (tier 1): the shards get SIGTERM only once
/// every coordinator is gone, and have their own grace period then.
#[test]
fn a_stop_goes_tier_by_tier_lowest_first() {
    let t0 = Instant::now();
    let mut sup = Supervisor::new(3, policy()).with_tiers(&[1, 0, 1]);
    sup.start(t0);
    let stopping = |running| {
        Action::Note(Note::Stopping {
            running,
            grace: secs(10),
        })
    };
    assert_eq!(
        sup.handle(Event::StopRequested, t0),
        vec![stopping(1), Action::Terminate(ChildId(1))]
    );
    // The coordinator's grace runs out: it is killed; the shards are not touched yet.
    assert_eq!(
        sup.handle(Event::Tick, t0 + secs(10)),
        vec![
            Action::Note(Note::GraceOver { left: 1 }),
            Action::Kill(ChildId(1))
        ]
    );
    let exit = |child| Event::Exited {
        child: ChildId(child),
        termination: Termination::Code(0),
    };
    let stopped = |child| {
        Action::Note(Note::Stopped {
            child: ChildId(child),
            termination: Termination::Code(0),
        })
    };
    assert_eq!(
        sup.handle(exit(1), t0 + secs(11)),
        vec![
            stopped(1),
            stopping(2),
            Action::Terminate(ChildId(0)),
            Action::Terminate(ChildId(2)),
        ]
    );
    assert_eq!(sup.next_wakeup(), Some(t0 + secs(21)));
    assert_eq!(sup.handle(exit(0), t0 + secs(12)), vec![stopped(0)]);
    assert_eq!(
        sup.handle(exit(2), t0 + secs(12)),
        vec![stopped(2), Action::Exit]
    );
}
