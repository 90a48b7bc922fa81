use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::*;

/// Serves a one-route router under `limits`; returns its address.
async fn start(limits: ConnLimits) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = Router::new().route("/", get(|| async { "hello" }));
    tokio::spawn(serve(listener, app, limits, std::future::pending()));
    addr
}

/// Sends one GET on `stream` and reads the answer's head and body (it is small).
async fn get_once(stream: &mut TcpStream) -> String {
    stream
        .write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf))
        .await
        .expect("an answer")
        .unwrap();
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// Everything until the server closes the connection.
async fn read_to_close(stream: &mut TcpStream) -> String {
    let mut text = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut text))
        .await
        .expect("the server closes the connection")
        .unwrap();
    String::from_utf8_lossy(&text).into_owned()
}

#[tokio::test]
async fn a_connection_past_the_limit_gets_503_and_a_freed_place_is_taken_again() {
    let addr = start(ConnLimits {
        max_connections: 1,
        ..ConnLimits::default()
    })
    .await;
    let mut first = TcpStream::connect(addr).await.unwrap();
    assert!(get_once(&mut first).await.starts_with("HTTP/1.1 200"));
    // The first stays open (keep-alive): the second is one too many.
    let mut second = TcpStream::connect(addr).await.unwrap();
    second
        .write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let refused = read_to_close(&mut second).await;
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
    assert!(refused.contains("retry-after: 1"), "{refused}");
    assert!(refused.contains("limit of 1 connections"), "{refused}");
    let body = refused.split("\r\n\r\n").nth(1).unwrap();
    let envelope: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(envelope["error"]["type"], "service_unavailable_error");
    drop(first);
    // Its place is freed once the server sees it closed.
    let mut third = None;
    for _ in 0..100 {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        if get_once(&mut stream).await.starts_with("HTTP/1.1 200") {
            third = Some(stream);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(third.is_some(), "the freed place was never taken again");
}

#[tokio::test]
async fn headers_that_do_not_arrive_in_time_close_the_connection() {
    let addr = start(ConnLimits {
        max_connections: 1,
        header_timeout: Duration::from_millis(300),
        ..ConnLimits::default()
    })
    .await;
    // A slow sender: half a request line, then nothing.
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"GET / HT").await.unwrap();
    read_to_close(&mut slow).await;
    // It held the only place until then; now another client is served.
    let mut next = TcpStream::connect(addr).await.unwrap();
    let mut answer = get_once(&mut next).await;
    for _ in 0..100 {
        if answer.starts_with("HTTP/1.1 200") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        next = TcpStream::connect(addr).await.unwrap();
        answer = get_once(&mut next).await;
    }
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}
