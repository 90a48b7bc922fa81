use std::time::{Duration, Instant};

use axum::response::IntoResponse;

use super::*;
use crate::api::auth::{Caller, KeyKind};

fn key(index: usize) -> Caller {
    Caller::Key {
        kind: KeyKind::Inference,
        index,
    }
}

fn limits() -> ApiLimits {
    ApiLimits {
        max_in_flight: 0,
        max_in_flight_per_key: 0,
        rate_per_key: 0.0,
        rate_burst: 0.0,
        ..ApiLimits::default()
    }
}

#[test]
fn the_in_flight_limit_counts_every_key_until_tickets_leave() {
    let gate = Gate::new(ApiLimits {
        max_in_flight: 2,
        ..limits()
    });
    let now = Instant::now();
    let a = gate.enter(key(0), now).unwrap();
    let b = gate.enter(key(1), now).unwrap();
    assert_eq!(
        gate.enter(key(2), now).unwrap_err(),
        Shed::InFlight { limit: 2 }
    );
    drop(a);
    let c = gate.enter(key(2), now).unwrap();
    assert_eq!(gate.in_flight(), 2);
    drop((b, c));
    assert_eq!(gate.in_flight(), 0);
    // Nothing is kept for keys with nothing in flight.
    assert!(gate.state.lock().unwrap().per_key.is_empty());
}

#[test]
fn the_per_key_limit_holds_one_key_only() {
    let gate = Gate::new(ApiLimits {
        max_in_flight_per_key: 1,
        ..limits()
    });
    let now = Instant::now();
    let held = gate.enter(key(0), now).unwrap();
    assert_eq!(
        gate.enter(key(0), now).unwrap_err(),
        Shed::KeyInFlight { limit: 1 }
    );
    let _other = gate.enter(key(1), now).unwrap();
    let _anyone = gate.enter(Caller::Anyone, now).unwrap();
    drop(held);
    let _again = gate.enter(key(0), now).unwrap();
}

#[test]
fn the_rate_refills_over_time_and_says_when_the_next_request_fits() {
    let gate = Gate::new(ApiLimits {
        rate_per_key: 2.0,
        rate_burst: 3.0,
        ..limits()
    });
    let t0 = Instant::now();
    for _ in 0..3 {
        drop(gate.enter(key(0), t0).unwrap());
    }
    let Err(Shed::Rate { rate, retry_after }) = gate.enter(key(0), t0) else {
        panic!("the burst is spent");
    };
    assert_eq!(rate, 2.0);
    assert_eq!(retry_after, Duration::from_millis(500));
    // Another key has its own bucket.
    drop(gate.enter(key(1), t0).unwrap());
    // Half a second later one more fits, and only one.
    let t1 = t0 + Duration::from_millis(500);
    drop(gate.enter(key(0), t1).unwrap());
    assert!(matches!(gate.enter(key(0), t1), Err(Shed::Rate { .. })));
    // A long pause refills to the burst, no more.
    let t2 = t1 + Duration::from_secs(60);
    for _ in 0..3 {
        drop(gate.enter(key(0), t2).unwrap());
    }
    assert!(gate.enter(key(0), t2).is_err());
}

#[test]
fn a_refused_request_takes_no_token_and_no_place() {
    let gate = Gate::new(ApiLimits {
        max_in_flight: 1,
        rate_per_key: 1.0,
        rate_burst: 2.0,
        ..limits()
    });
    let now = Instant::now();
    let held = gate.enter(key(0), now).unwrap();
    assert!(matches!(
        gate.enter(key(0), now),
        Err(Shed::InFlight { .. })
    ));
    drop(held);
    // The refusal above spent nothing: the second token of the burst is still there.
    drop(gate.enter(key(0), now).unwrap());
    assert!(matches!(gate.enter(key(0), now), Err(Shed::Rate { .. })));
}

#[test]
fn sheds_are_429_with_retry_after() {
    let response = ApiError::from(Shed::Rate {
        rate: 0.25,
        retry_after: Duration::from_millis(3_200),
    })
    .into_response();
    assert_eq!(response.status().as_u16(), 429);
    assert_eq!(response.headers()["retry-after"], "4");
    let response = ApiError::from(Shed::InFlight { limit: 8 }).into_response();
    assert_eq!(response.status().as_u16(), 429);
    assert_eq!(response.headers()["retry-after"], "1");
}
