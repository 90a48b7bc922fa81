//! The queue waits the scheduler reports for the queue-time histogram.

use std::time::Duration;

use super::*;

#[test]
fn each_new_request_reports_its_wait_before_its_first_admission_once() {
    let t0 = Instant::now();
    let mut s = Scheduler::new(Term(1), config(256));
    s.start_epoch(Epoch(1), 100, 16, Vec::new(), t0);
    s.submit(SeqId(1), "", request(5, 3), Vec::new(), t0)
        .unwrap();
    s.submit(
        SeqId(2),
        "",
        request(5, 3),
        Vec::new(),
        t0 + Duration::from_millis(10),
    )
    .unwrap();
    assert!(s.take_queue_waits().is_empty(), "nothing admitted yet");
    let admitted_at = t0 + Duration::from_millis(250);
    let plan = s.plan_step(admitted_at).unwrap();
    assert_eq!(plan.new.len(), 2);
    let mut waits = s.take_queue_waits();
    waits.sort();
    assert_eq!(
        waits,
        [Duration::from_millis(240), Duration::from_millis(250)]
    );
    // Taken: later steps report nothing more for them.
    s.plan_step(admitted_at).unwrap();
    assert!(s.take_queue_waits().is_empty());
}
