//! A non-streamed request's id before its body (issue 17, item 8): `Prefer: respond-async`
//! answers 202 with the id at once; the leader is then killed mid-run, and the result is
//! fetched from another peer by that id, with the tokens of a run without the fault.

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde_json::json;
use tessera_tests::failover::{references, slow_three_peers, wait_for_leader};
use tessera_tests::{get, post_with, token_ids};

#[test]
fn a_request_answered_202_is_fetched_by_its_id_after_the_leader_is_killed() {
    const TOKENS: usize = 40;
    let (mut cluster, urls) = slow_three_peers();
    let all: Vec<&str> = urls.iter().map(String::as_str).collect();
    let leader = wait_for_leader(&all, None, Duration::from_secs(20));
    let prompt = vec![3, 8, 2, 6];
    let reference = references(all[0], std::slice::from_ref(&prompt), TOKENS).remove(0);
    let body = json!({
        "model": "m", "prompt": prompt, "max_tokens": TOKENS,
        "temperature": 0, "ignore_eos": true, "return_token_ids": true,
    });
    let url = format!("{}/v1/completions", all[leader as usize - 1]);
    let prefer = [("Prefer", "respond-async")];
    let (status, accepted) = post_with(&url, &body, &prefer).expect("POST");
    assert_eq!(status, 202, "{accepted}\n{}", cluster.logs());
    let id = accepted["id"].as_str().expect("an id").to_string();
    let location = accepted["result"]
        .as_str()
        .expect("a result location")
        .to_string();
    assert_eq!(location, format!("/v1/streams/{id}?stream=false"));
    // 40 steps of 60 ms: the kill lands mid-run.
    std::thread::sleep(Duration::from_millis(800));
    cluster.signal(&format!("coordinator-{leader}"), Signal::SIGKILL);
    let other = all
        .iter()
        .enumerate()
        .find(|(i, _)| *i as u64 + 1 != leader)
        .map(|(_, u)| *u)
        .expect("another peer");
    let deadline = Instant::now() + Duration::from_secs(30);
    let answer = loop {
        match get(&format!("{other}{location}")) {
            Ok((200, answer)) => break answer,
            // No leader yet, or the new one not yet resuming the journal.
            Ok((status, answer)) if matches!(status, 404 | 429 | 503) => {
                assert!(Instant::now() < deadline, "still {status}: {answer}");
            }
            other => panic!("the fetch failed: {other:?}\n{}", cluster.logs()),
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(answer["id"], id.as_str());
    let tokens = token_ids(&answer).expect("token ids");
    assert_eq!(
        tokens, reference,
        "the fetched tokens differ from a run without the fault"
    );
    assert_eq!(answer["choices"][0]["finish_reason"], "length");
}
