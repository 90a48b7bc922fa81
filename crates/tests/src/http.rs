//! The tests' HTTP client for a cluster's API: JSON `POST` and `GET` with the test API
//! key, one Prometheus metric, Server-Sent Events streams read to the end, and waiting
//! for `/ready`.

use std::time::{Duration, Instant};

use anyhow::{Context, anyhow};
use serde_json::Value;

/// The API key of coordinators the tests start; [`post`] always sends it (a coordinator
/// without keys ignores it).
pub const TEST_API_KEY: &str = "tessera-test-key";

/// The admin key every test coordinator accepts (`--admin-key`): it alone changes the
/// cluster.
pub const TEST_ADMIN_KEY: &str = "tessera-test-admin-key";

/// `POST url` with a JSON body: the status and the JSON answer (errors included).
pub fn post(url: &str, body: &Value) -> anyhow::Result<(u16, Value)> {
    post_with(url, body, &[])
}

/// [`post`] with these headers too.
pub fn post_with(
    url: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> anyhow::Result<(u16, Value)> {
    post_as(TEST_API_KEY, url, body, headers)
}

/// [`post_with`] with API key `key` (the admin key, say).
pub fn post_as(
    key: &str,
    url: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> anyhow::Result<(u16, Value)> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into();
    let mut request = agent
        .post(url)
        .header("Authorization", &format!("Bearer {key}"));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let mut response = request
        .send_json(body)
        .with_context(|| format!("POST {url}"))?;
    let status = response.status().as_u16();
    let value: Value = response
        .body_mut()
        .read_json()
        .with_context(|| format!("POST {url}: the answer is not JSON"))?;
    Ok((status, value))
}

/// `GET url` with the test key: the status and the JSON answer.
pub fn get(url: &str) -> anyhow::Result<(u16, Value)> {
    get_as(TEST_API_KEY, url)
}

/// [`get`] with API key `key` (the admin key, say).
pub fn get_as(key: &str, url: &str) -> anyhow::Result<(u16, Value)> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(30)))
        .build()
        .into();
    let mut response = agent
        .get(url)
        .header("Authorization", &format!("Bearer {key}"))
        .call()
        .with_context(|| format!("GET {url}"))?;
    let status = response.status().as_u16();
    let value: Value = response
        .body_mut()
        .read_json()
        .with_context(|| format!("GET {url}: the answer is not JSON"))?;
    Ok((status, value))
}

/// The value of Prometheus series `name` at `{http}/metrics`, summed over its label sets
/// that contain `labels` (`""` for all); 0 when absent.
pub fn metric(http: &str, name: &str, labels: &str) -> anyhow::Result<f64> {
    let text = ureq::get(format!("{http}/metrics"))
        .call()
        .context("GET /metrics")?
        .body_mut()
        .read_to_string()?;
    let mut total = 0.0;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with('{') || rest.starts_with(' ')) || !rest.contains(labels) {
            continue;
        }
        let value = rest
            .rsplit(' ')
            .next()
            .ok_or_else(|| anyhow!("bad line {line}"))?;
        total += value
            .parse::<f64>()
            .with_context(|| format!("bad value in {line}"))?;
    }
    Ok(total)
}

/// One server-sent event: its `id:` and `data:`.
#[derive(Clone, Debug, PartialEq)]
pub struct SseEvent {
    pub id: Option<String>,
    pub data: String,
}

/// Reads server-sent events from `url` (`POST` with `body`, else `GET` with
/// `last_event_id`) until `[DONE]`: the events, and whether `[DONE]` arrived (false when
/// the connection broke first, or the status was not 200).
pub fn sse(url: &str, body: Option<&Value>, last_event_id: Option<&str>) -> (Vec<SseEvent>, bool) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into();
    let auth = format!("Bearer {TEST_API_KEY}");
    let response = match body {
        Some(body) => agent
            .post(url)
            .header("Authorization", &auth)
            .send_json(body),
        None => {
            let mut request = agent.get(url).header("Authorization", &auth);
            if let Some(last) = last_event_id {
                request = request.header("Last-Event-ID", last);
            }
            request.call()
        }
    };
    let response = match response {
        Ok(r) => r,
        Err(error) => {
            eprintln!("sse {url}: {error}");
            return (Vec::new(), false);
        }
    };
    if response.status() != 200 {
        eprintln!("sse {url}: status {}", response.status());
        return (Vec::new(), false);
    }
    read_sse(
        std::io::BufReader::new(response.into_body().into_reader()),
        |_| true,
    )
}

/// Server-sent events from `reader` until `[DONE]`, or until `more` says no after an event:
/// the events, and whether `[DONE]` arrived (false when the stream broke first or `more`
/// stopped it).
pub fn read_sse(
    reader: impl std::io::BufRead,
    mut more: impl FnMut(&SseEvent) -> bool,
) -> (Vec<SseEvent>, bool) {
    let mut events = Vec::new();
    let mut id = None;
    for line in reader.lines() {
        let Ok(line) = line else {
            return (events, false);
        };
        if let Some(v) = line.strip_prefix("id:") {
            id = Some(v.trim().to_string());
        } else if let Some(v) = line.strip_prefix("data:") {
            let data = v.trim().to_string();
            let done = data == "[DONE]";
            events.push(SseEvent {
                id: id.take(),
                data,
            });
            if done {
                return (events, true);
            }
            if !more(&events[events.len() - 1]) {
                return (events, false);
            }
        }
    }
    (events, false)
}

/// `choices[0].token_ids` of a completion.
pub fn token_ids(answer: &Value) -> anyhow::Result<Vec<u32>> {
    answer["choices"][0]["token_ids"]
        .as_array()
        .ok_or_else(|| anyhow!("no choices[0].token_ids in {answer}"))?
        .iter()
        .map(|v| {
            v.as_u64()
                .map(|t| t as u32)
                .ok_or_else(|| anyhow!("token id {v} is not a number"))
        })
        .collect()
}

/// Waits until `{http}/ready` answers 200 (every model's groups have warmed up and one of
/// each serves); panics after `timeout` with `logs()`.
pub fn wait_ready(http: &str, timeout: Duration, logs: impl Fn() -> String) {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(r) = ureq::get(format!("{http}/ready")).call()
            && r.status() == 200
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "not ready after {timeout:?}\n{}",
            logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
