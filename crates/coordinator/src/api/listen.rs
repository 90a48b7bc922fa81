//! Serving the API's router over HTTP/1.1 under connection limits.
//!
//! - **Connections.** At most [`ConnLimits::max_connections`] at once. One more is answered
//!   `503` with `Retry-After` (the OpenAI envelope, `Connection: close`) and closed, so a
//!   client learns why instead of waiting in the listen backlog; at most
//!   [`REFUSING_AT_ONCE`] such answers are written at once, and connections past those are
//!   closed unanswered.
//! - **Headers.** A request's headers must arrive within [`ConnLimits::header_timeout`],
//!   counted from when the connection waits for them (a keep-alive connection's idle time
//!   included): a slow sender cannot hold a connection open. Bodies have their own timeout
//!   in [`super::limits`].
//! - **Writes.** A write that finds no room in the socket for [`ConnLimits::write_timeout`]
//!   (the client stopped reading) closes the connection ([`TimedIo`]). The response body is
//!   dropped with it: a stream's sequences are cancelled and their KV blocks freed, and the
//!   request leaves the in-flight count.
//! - **Shutdown.** When `shutdown` resolves, the listener closes, each connection finishes
//!   the request it is serving, and [`serve`] returns once all have closed.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::time::Sleep;
use tracing::{debug, warn};

use super::error::{ApiError, ApiErrorKind};
use crate::metrics as names;

/// Connections answered 503 at once, past the limit.
pub const REFUSING_AT_ONCE: usize = 64;

/// How long a refused connection is given to take its 503.
const REFUSAL_TIME: Duration = Duration::from_secs(1);

/// After an accept error such as running out of file descriptors, wait this long.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnLimits {
    /// Connections open at once.
    pub max_connections: usize,
    /// A request's headers must arrive within this.
    pub header_timeout: Duration,
    /// A write may wait this long for room in the socket.
    pub write_timeout: Duration,
}

impl Default for ConnLimits {
    fn default() -> ConnLimits {
        ConnLimits {
            max_connections: 4096,
            header_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(30),
        }
    }
}

/// Serves `app` on `listener` until `shutdown` resolves and every connection has closed
/// (within [`CLOSE_WAIT`]; then they are cut).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()>,
) {
    let open = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let refusing = Arc::new(Semaphore::new(REFUSING_AT_ONCE));
    let graceful = GracefulShutdown::new();
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        let (stream, remote) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of file descriptors or memory: the connections open must close
                // before more can be taken. Per-connection errors are not returned here.
                warn!(%error, "accepting an HTTP connection failed");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let Ok(permit) = Arc::clone(&open).try_acquire_owned() else {
            ::metrics::counter!(names::API_CONNECTIONS_REFUSED).increment(1);
            if let Ok(refusal) = Arc::clone(&refusing).try_acquire_owned() {
                let max = limits.max_connections;
                tokio::spawn(async move {
                    refuse(stream, max).await;
                    drop(refusal);
                });
            }
            continue;
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let io = TokioIo::new(TimedIo::new(stream, limits.write_timeout));
        let connection = graceful.watch(builder.serve_connection(io, service));
        let open = Arc::clone(&open);
        tokio::spawn(async move {
            ::metrics::gauge!(names::API_CONNECTIONS)
                .set((limits.max_connections - open.available_permits()) as f64);
            if let Err(error) = connection.await {
                debug!(%remote, %error, "HTTP connection ended with an error");
            }
            drop(permit);
            ::metrics::gauge!(names::API_CONNECTIONS)
                .set((limits.max_connections - open.available_permits()) as f64);
        });
    }
    drop(listener);
    // The drain has let the requests in flight end: what is open now is idle keep-alive
    // connections, which close at once, or requests the drain timed out on, which are cut.
    if tokio::time::timeout(CLOSE_WAIT, graceful.shutdown())
        .await
        .is_err()
    {
        warn!("HTTP connections still open {CLOSE_WAIT:?} after shutdown: closing them");
    }
}

/// How long connections may take to close once the server stops.
const CLOSE_WAIT: Duration = Duration::from_secs(2);

/// A socket whose writes fail with `TimedOut` once one has waited `timeout` for room.
struct TimedIo {
    stream: TcpStream,
    timeout: Duration,
    /// Armed while a write is pending.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl TimedIo {
    fn new(stream: TcpStream, timeout: Duration) -> TimedIo {
        TimedIo {
            stream,
            timeout,
            stalled: None,
        }
    }

    /// What a pending write means: wait on, unless it has waited too long.
    fn pending<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        let timeout = self.timeout;
        let stalled = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        if stalled.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        ::metrics::counter!(names::API_WRITE_TIMEOUTS).increment(1);
        debug!(
            waited_s = timeout.as_secs_f64(),
            "the client stopped reading: closing"
        );
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "the client read nothing within the write timeout",
        )))
    }

    /// A write that made progress (or failed) disarms the timer.
    fn done<T>(
        &mut self,
        result: Poll<io::Result<T>>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<T>> {
        match result {
            Poll::Pending => self.pending(cx),
            ready => {
                self.stalled = None;
                ready
            }
        }
    }
}

impl AsyncRead for TimedIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for TimedIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.stream).poll_write(cx, buf);
        self.done(result, cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.done(result, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let result = Pin::new(&mut self.stream).poll_flush(cx);
        self.done(result, cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// Answers a connection past the limit with 503 and closes it, reading what the client
/// sent meanwhile so that the close does not reset the answer away.
async fn refuse(mut stream: TcpStream, max_connections: usize) {
    let error = ApiError::new(
        ApiErrorKind::Unavailable,
        format!(
            "this coordinator has its limit of {max_connections} connections open; retry later"
        ),
    );
    let body = error.to_json().to_string();
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         retry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(REFUSAL_TIME, async {
        stream.write_all(answer.as_bytes()).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        while stream.read(&mut sink).await? > 0 {}
        Ok::<_, io::Error>(())
    })
    .await;
}

#[cfg(test)]
mod tests;
