//! The seam for the fuzz targets in `crates/comm/fuzz`: the decoders of what a TCP ring
//! reads from the network, the hello and handshake of a connection that is not yet
//! authenticated and the header of each frame. Public only for fuzzing; nothing else
//! should call these.

use super::frame::{HEADER_BYTES, check_header};
use super::handshake::{Channel, as_acceptor};
use super::hello::JoinKey;
pub use super::hello::{HELLO_BYTES, Hello, Refusal};
use crate::collective::GroupToken;

/// Decodes a hello from `bytes`: exactly [`HELLO_BYTES`] of them, else `None`. A hello
/// that decodes is then checked with [`Hello::expect`] and re-encoded with
/// [`Hello::encode`].
pub fn decode_hello(bytes: &[u8]) -> Option<Result<Hello, Refusal>> {
    let bytes = <&[u8; HELLO_BYTES]>::try_from(bytes).ok()?;
    Some(Hello::decode(bytes))
}

/// The peer's bytes of one connection, then its end.
#[derive(Debug)]
struct Replay<'a> {
    input: &'a [u8],
}

impl Channel for Replay<'_> {
    fn send(&mut self, _bytes: &[u8]) -> Result<(), Refusal> {
        Ok(())
    }

    fn receive(&mut self, buf: &mut [u8]) -> Result<(), Refusal> {
        if self.input.len() < buf.len() {
            return Err(Refusal::Closed);
        }
        let (now, rest) = self.input.split_at(buf.len());
        buf.copy_from_slice(now);
        self.input = rest;
        Ok(())
    }
}

/// Runs the acceptor's handshake (rank 1 of a ring of 2, with a fixed token and nonce)
/// against a connector that sends `input` and then closes. Without the token no input can
/// authenticate, so every outcome is a refusal.
pub fn accept(input: &[u8]) -> Result<(), Refusal> {
    let peers = ["127.0.0.1:1".to_string(), "127.0.0.1:2".to_string()];
    let key = JoinKey::new(&GroupToken([0x5a; 32]), &peers);
    let mine = Hello {
        version: super::hello::VERSION,
        rank: 1,
        world: 2,
        nonce: [7; 32],
    };
    as_acceptor(&mut Replay { input }, &key, &mine, 0)
}

/// Checks `header` (exactly 12 bytes, else `None`) as the header of a frame of `code`,
/// `bytes` and `total`, as a rank receiving one does; `Err` says what it is instead.
pub fn check_frame_header(
    header: &[u8],
    code: u32,
    bytes: u32,
    total: u32,
) -> Option<Result<(), String>> {
    let header = <&[u8; HEADER_BYTES]>::try_from(header).ok()?;
    Some(check_header(header, code, bytes, total).map_err(|failure| format!("{failure:?}")))
}

/// The header a rank sends for a frame of `code`, `bytes` and `total`.
pub fn frame_header(code: u32, bytes: u32, total: u32) -> [u8; HEADER_BYTES] {
    super::frame::frame_header(code, bytes, total)
}
