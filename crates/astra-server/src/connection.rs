//! Connections: the accept loop and its cap, and what goes on the wire outside the
//! router's responses: a 408 for a request head that runs out of time, OpenAI-shaped
//! bodies on the answers hyper gives malformed heads, and a write timeout for clients
//! that stop reading.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Sleep;

use crate::api::ApiError;
use crate::http::unavailable;

/// The most `--max-connections` may be (far above any descriptor limit).
pub const MAX_CONNECTIONS: usize = 1 << 20;

/// Connections over the cap being answered at once; past this they get the answer
/// without waiting for their close (an unread request then resets the connection).
const MAX_REFUSING: usize = 1024;

/// How long a connection over the cap is held for its answer to be read: short, so that
/// a flood of idle connections does not keep the refusals busy.
const REFUSAL_LINGER: Duration = Duration::from_millis(500);

/// How long a closing answer to a request may take to be read.
const ANSWER_LINGER: Duration = Duration::from_secs(2);

/// What one connection may take.
#[derive(Clone, Copy, Debug)]
pub struct ConnectionLimits {
    /// Open connections; the next gets 503 and is closed.
    pub max: usize,
    /// For a request's head to arrive, counted from when the connection starts waiting
    /// for it (so also the longest an idle keep-alive connection stays open).
    pub header_timeout: Duration,
    /// For a client to take bytes the server is writing; the connection is closed after.
    pub write_timeout: Duration,
}

/// Serves HTTP/1.1 connections on `listener` until `shutdown` completes, then waits for
/// the open ones to finish their requests.
pub async fn accept_loop(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    limits: ConnectionLimits,
    shutdown: impl std::future::Future<Output = ()>,
) -> io::Result<()> {
    let mut graceful = Some(hyper_util::server::graceful::GracefulShutdown::new());
    let permits = Arc::new(tokio::sync::Semaphore::new(limits.max));
    let refusals = Arc::new(tokio::sync::Semaphore::new(MAX_REFUSING));
    tokio::pin!(shutdown);
    // Until the shutdown signal, then until the connections open at that moment have
    // finished; connections accepted meanwhile are answered 503 by the router.
    let mut drained: Option<Pin<Box<dyn std::future::Future<Output = ()> + Send>>> = None;
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown, if graceful.is_some() => {
                let watching = graceful.take().expect("guarded");
                drained = Some(Box::pin(watching.shutdown()));
                continue;
            }
            _ = async { drained.as_mut().expect("guarded").await }, if drained.is_some() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors, or a connection reset before it was
                    // taken: the listener itself is fine.
                    eprintln!("astra: WARN accepting a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
            let refusal = unavailable("too many open connections; try again shortly".into());
            match Arc::clone(&refusals).try_acquire_owned() {
                Ok(refusing) => {
                    tokio::spawn(async move {
                        answer_and_close(stream, refusal, REFUSAL_LINGER).await;
                        drop(refusing);
                    });
                }
                // The answer fits the empty socket buffer in one write.
                Err(_) => {
                    let _ = stream.try_write(&closing_response(&refusal));
                }
            }
            continue;
        };
        let _ = stream.set_nodelay(true);
        let wire = Wire::new(stream, limits.write_timeout);
        let state = Arc::clone(&wire.state);
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .serve_connection(hyper_util::rt::TokioIo::new(wire), service);
        let finish = move |result: Result<(), hyper::Error>| async move {
            if let Some(answer) = state.closing_answer(&result) {
                if let Some(stream) = Arc::into_inner(state).map(|s| s.stream) {
                    answer_and_close(stream, answer, ANSWER_LINGER).await;
                }
            }
            drop(permit);
        };
        match &graceful {
            Some(watching) => {
                let conn = watching.watch(conn);
                tokio::spawn(async move { finish(conn.await).await });
            }
            None => {
                tokio::spawn(async move { finish(conn.await).await });
            }
        }
    }
    Ok(())
}

/// The answer in place of hyper's empty one for a head it could not parse.
fn malformed(status: u16) -> ApiError {
    let message = match status {
        414 => "the request target is too long",
        431 => "the request head is too large",
        _ => "malformed request head",
    };
    ApiError {
        status,
        message: message.into(),
        kind: "invalid_request_error",
        param: None,
    }
}

/// `e` as a whole response the server writes itself before closing the connection:
/// the router's error body and `Retry-After` rule, `Connection: close`.
fn closing_response(e: &ApiError) -> Vec<u8> {
    let body = e.body().to_string();
    let reason = axum::http::StatusCode::from_u16(e.status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("Error");
    let retry = if e.retry_shortly() {
        "retry-after: 1\r\n"
    } else {
        ""
    };
    format!(
        "HTTP/1.1 {} {reason}\r\ncontent-type: application/json\r\n{retry}\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        e.status,
        body.len()
    )
    .into_bytes()
}

/// Writes `answer`, then closes the connection once the client has closed its end or
/// `linger` has passed.
async fn answer_and_close(mut stream: TcpStream, answer: ApiError, linger: Duration) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = tokio::time::timeout(linger, async {
        let _ = stream.write_all(&closing_response(&answer)).await;
        let _ = stream.shutdown().await;
        // What the client sent is read and dropped: closing with it unread would reset
        // the connection, and the client might not see the answer.
        let mut sink = [0u8; 4096];
        while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
    })
    .await;
}

/// What a connection's wire and its closing code share.
struct WireState {
    stream: TcpStream,
    /// Bytes have arrived since the server last wrote: a request head is under way.
    head_started: AtomicBool,
    /// The status of an answer hyper wrote to a malformed head, held back (0: none).
    withheld: AtomicU16,
}

impl WireState {
    /// What to write before closing, given how hyper ended the connection.
    fn closing_answer(&self, result: &Result<(), hyper::Error>) -> Option<ApiError> {
        let withheld = self.withheld.load(Ordering::Relaxed);
        if withheld != 0 {
            return Some(malformed(withheld));
        }
        match result {
            // A head under way when its time ran out; an idle keep-alive connection
            // that times out is closed without a word.
            Err(e) if e.is_timeout() && self.head_started.load(Ordering::Relaxed) => {
                Some(ApiError {
                    status: 408,
                    message: "the request head took too long to arrive".into(),
                    kind: "invalid_request_error",
                    param: None,
                })
            }
            _ => None,
        }
    }
}

/// The connection's socket as hyper sees it: reads and writes pass through, noting
/// when a request head starts; writes that make no progress for the write timeout fail;
/// hyper's bodiless answer to a malformed head is held back so the closing code can
/// write one with a body.
struct Wire {
    state: Arc<WireState>,
    write_timeout: Duration,
    /// Armed while a write waits for the client to take bytes.
    write_deadline: Option<Pin<Box<Sleep>>>,
}

impl Wire {
    fn new(stream: TcpStream, write_timeout: Duration) -> Wire {
        Wire {
            state: Arc::new(WireState {
                stream,
                head_started: AtomicBool::new(false),
                withheld: AtomicU16::new(0),
            }),
            write_timeout,
            write_deadline: None,
        }
    }

    /// Waits until the socket takes bytes, failing once the write timeout has passed
    /// without progress.
    fn poll_writable(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.state.stream.poll_write_ready(cx) {
            Poll::Ready(r) => {
                self.write_deadline = None;
                Poll::Ready(r)
            }
            Poll::Pending => {
                let timeout = self.write_timeout;
                let deadline = self
                    .write_deadline
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
                ready!(deadline.as_mut().poll(cx));
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client stopped reading",
                )))
            }
        }
    }

    /// Whether `bytes`, about to be written, are hyper's answer to a malformed head;
    /// holds them back if so.
    fn withhold(&self, bytes: &[u8]) -> bool {
        if !self.state.head_started.load(Ordering::Relaxed) {
            return false;
        }
        match automatic_error_status(bytes) {
            Some(status) => {
                self.state.withheld.store(status, Ordering::Relaxed);
                true
            }
            None => false,
        }
    }

    /// Writes with `write` once the socket takes bytes; a write marks the end of any
    /// request head.
    fn poll_write_with(
        &mut self,
        cx: &mut Context<'_>,
        write: impl Fn(&TcpStream) -> io::Result<usize>,
    ) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.poll_writable(cx))?;
            match write(&self.state.stream) {
                Ok(n) => {
                    if n > 0 {
                        self.state.head_started.store(false, Ordering::Relaxed);
                    }
                    return Poll::Ready(Ok(n));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncRead for Wire {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let stream = &self.state.stream;
        loop {
            ready!(stream.poll_read_ready(cx))?;
            match stream.try_read(buf.initialize_unfilled()) {
                Ok(n) => {
                    buf.advance(n);
                    if n > 0 {
                        self.state.head_started.store(true, Ordering::Relaxed);
                    }
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for Wire {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.withhold(buf) {
            return Poll::Ready(Ok(buf.len()));
        }
        self.poll_write_with(cx, |stream| stream.try_write(buf))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if let [only] = bufs {
            if self.withhold(only) {
                return Poll::Ready(Ok(only.len()));
            }
        }
        self.poll_write_with(cx, |stream| stream.try_write_vectored(bufs))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        // A withheld answer still has to be written: the closing code shuts down then.
        if self.state.withheld.load(Ordering::Relaxed) != 0 {
            return Poll::Ready(Ok(()));
        }
        Poll::Ready(socket2::SockRef::from(&self.state.stream).shutdown(std::net::Shutdown::Write))
    }
}

/// The status of `bytes` if they are a whole response head of the kind hyper writes on
/// its own for a head it cannot parse (400, 414 or 431, no body). The router never
/// writes these: every error it answers has a JSON body.
fn automatic_error_status(bytes: &[u8]) -> Option<u16> {
    let head = bytes.strip_suffix(b"\r\n\r\n")?;
    let text = std::str::from_utf8(head).ok()?;
    let mut lines = text.split("\r\n");
    let status_line = lines.next()?;
    let rest = status_line
        .strip_prefix("HTTP/1.1 ")
        .or_else(|| status_line.strip_prefix("HTTP/1.0 "))?;
    let status: u16 = rest.get(..3)?.parse().ok()?;
    if !matches!(status, 400 | 414 | 431) {
        return None;
    }
    let empty = lines.any(|line| {
        line.split_once(':').is_some_and(|(name, value)| {
            name.eq_ignore_ascii_case("content-length") && value.trim() == "0"
        })
    });
    empty.then_some(status)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hypers_own_answers_are_recognised_and_nothing_else() {
        let own = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\ndate: Fri, 04 Dec 2026 \
                    10:00:00 GMT\r\n\r\n";
        assert_eq!(automatic_error_status(own), Some(400));
        assert_eq!(
            automatic_error_status(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n\r\n"
            ),
            Some(431)
        );
        for other in [
            &b"HTTP/1.1 400 Bad Request\r\ncontent-length: 52\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n{}",
            b"HTTP/1.1 400 Bad Request\r\ntransfer-encoding: chunked\r\n\r\n",
            b"data: {}\n\n",
        ] {
            assert_eq!(
                automatic_error_status(other),
                None,
                "{}",
                String::from_utf8_lossy(other)
            );
        }
    }

    /// A client that never reads: writes fill the socket's buffers, then fail once the
    /// write timeout passes without progress.
    #[tokio::test]
    async fn a_write_that_makes_no_progress_times_out() {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        let mut wire = Wire::new(server, Duration::from_millis(300));
        let chunk = vec![b'x'; 1 << 16];
        let mut written = 0usize;
        let error = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                match wire.write(&chunk).await {
                    Ok(n) => written += n,
                    Err(e) => break e,
                }
                assert!(written < 1 << 30, "the socket never filled");
            }
        })
        .await
        .expect("the stalled write never timed out");
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert!(written > 0);
        drop(client);
    }

    #[test]
    fn refusals_are_whole_responses_with_json_bodies() {
        let bytes = closing_response(&malformed(431));
        let text = String::from_utf8(bytes).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"));
        assert!(head.contains(&format!("content-length: {}", body.len())));
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
}
