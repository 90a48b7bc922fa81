//! Encoding of control messages and the frames that carry them.
//!
//! A message is encoded with bincode 2 (`standard()` configuration: little-endian,
//! variable-length integers) through its serde implementation. A frame is a `u32`
//! little-endian payload length followed by the payload:
//!
//! ```text
//! +----------------+---------------------------+
//! | len: u32 (LE)  | payload: len bytes        |
//! +----------------+---------------------------+
//! ```
//!
//! Everything read from a peer is bounded before it is trusted: [`read_frame`] compares the
//! length prefix with the caller's limit before it reserves any memory, [`decode`] refuses
//! input longer than the limit and any byte left over after the message, and bincode's own
//! allocation limit is set from the input's size, so a forged string length reserves at
//! most 32 times the input. Malformed input is an error, never a panic (the fuzz targets in
//! `crates/comm/fuzz` and the stable test in `tests/wire.rs` hold this).
//!
//! A few values outgrow one frame: a coordinator's snapshot of its replicated state.
//! [`encode_large`] and [`decode_large`] handle those, up to [`MAX_LARGE_BYTES`], with the
//! same checks; the caller carries them in several frames.
//!
//! [`read_frame`] and [`write_frame`] work on any tokio `AsyncRead` / `AsyncWrite`, among
//! them quinn's `RecvStream` and `SendStream`. [`split_frame`] is the same framing over a
//! byte buffer, for callers that receive whole datagrams or buffers.

use bincode::config::{Configuration, Limit, LittleEndian, Varint};
use bincode::error::DecodeError;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::CommError;

/// The largest payload a frame may carry, and the most any peer may send.
///
/// The largest message is a step plan ([`crate::proto::StepPlan`]) whose prefill carries
/// whole prompts. A token id costs at most 5 bytes in bincode's variable-length encoding
/// (ids above 65 535 — large vocabularies — take 5), so 16 MiB holds about 3.3 million
/// prompt tokens: 25 prompts of 128 k tokens in one step, far beyond any per-step token
/// budget. Every other message is a few hundred bytes. Bounding the frame at 16 MiB keeps
/// what a broken or hostile peer can make us hold per stream small, and matches the QUIC
/// stream window (see [`crate::quic`]), which admits two full frames in flight.
pub const MAX_FRAME_BYTES: usize = 16 << 20;

/// The largest value [`encode_large`] writes and [`decode_large`] reads: a coordinator's
/// snapshot, which its journal budget keeps far smaller.
pub const MAX_LARGE_BYTES: usize = 1 << 30;

/// Bytes of the length prefix.
pub const FRAME_HEADER_BYTES: usize = 4;

/// How much [`read_frame`] reserves before the payload's bytes arrive: a frame announcing
/// many megabytes costs memory only as its bytes actually come in.
const INITIAL_READ_RESERVE_BYTES: usize = 64 << 10;

/// The bincode configuration of every message, with an allocation limit of `N` bytes.
type WireConfig<const N: usize> = Configuration<LittleEndian, Varint, Limit<N>>;

fn config<const N: usize>() -> WireConfig<N> {
    bincode::config::standard().with_limit::<N>()
}

/// The most bincode "claims" per input byte for our messages. Bincode's limit counts the
/// in-memory size of every value it decodes (8 for a `u64` that took one varint byte), and
/// reserves a string's bytes as soon as it has read its length, before it knows they
/// exist; the limit is what bounds that reservation. A `u64` in one byte is the densest
/// case, so a valid message of `L` bytes claims at most `8 * L`.
const CLAIM_RATIO: usize = 8;

/// Decodes with the allocation limit of the smallest tier that holds the input (the limit
/// is a const parameter in bincode, hence tiers, 4x apart): a valid message always fits,
/// and a forged string length reserves at most 32 times the input, and never more than
/// `CLAIM_RATIO` times the input's ceiling ([`MAX_FRAME_BYTES`], or [`MAX_LARGE_BYTES`]
/// for [`decode_large`]).
fn decode_limited<T: DeserializeOwned>(bytes: &[u8]) -> Result<(T, usize), DecodeError> {
    macro_rules! tiers {
        ($($bound:expr),*) => {
            $(
                if bytes.len() <= $bound {
                    return bincode::serde::decode_from_slice(
                        bytes,
                        config::<{ $bound * CLAIM_RATIO }>(),
                    );
                }
            )*
        };
    }
    tiers!(
        1 << 10,
        4 << 10,
        16 << 10,
        64 << 10,
        256 << 10,
        1 << 20,
        4 << 20,
        MAX_FRAME_BYTES,
        64 << 20,
        256 << 20
    );
    bincode::serde::decode_from_slice(bytes, config::<{ MAX_LARGE_BYTES * CLAIM_RATIO }>())
}

/// Encodes one message (no length prefix). Fails when the encoding exceeds
/// [`MAX_FRAME_BYTES`], so a message no peer would accept is refused at the sender.
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, CommError> {
    encode_large(msg, MAX_FRAME_BYTES)
}

/// Encodes a value that may outgrow a frame; fails past `limit` (capped at
/// [`MAX_LARGE_BYTES`]).
pub fn encode_large<T: Serialize>(msg: &T, limit: usize) -> Result<Vec<u8>, CommError> {
    let limit = limit.min(MAX_LARGE_BYTES);
    let bytes = bincode::serde::encode_to_vec(msg, config::<MAX_LARGE_BYTES>()).map_err(|e| {
        CommError::Encode {
            message: e.to_string(),
        }
    })?;
    if bytes.len() > limit {
        return Err(CommError::FrameTooLarge {
            len: bytes.len() as u64,
            limit,
        });
    }
    Ok(bytes)
}

/// Decodes exactly one message from `bytes`.
///
/// `limit` is the most bytes the caller accepts; it is capped at [`MAX_FRAME_BYTES`], the
/// protocol's ceiling. Input longer than the limit, a malformed message and bytes left
/// over after the message are errors.
pub fn decode<T: DeserializeOwned>(bytes: &[u8], limit: usize) -> Result<T, CommError> {
    decode_large(bytes, limit.min(MAX_FRAME_BYTES))
}

/// [`decode`] for a value that may outgrow a frame: `limit` is capped at
/// [`MAX_LARGE_BYTES`].
pub fn decode_large<T: DeserializeOwned>(bytes: &[u8], limit: usize) -> Result<T, CommError> {
    let limit = limit.min(MAX_LARGE_BYTES);
    if bytes.len() > limit {
        return Err(CommError::FrameTooLarge {
            len: bytes.len() as u64,
            limit,
        });
    }
    let (msg, read) = decode_limited(bytes).map_err(|e| CommError::Decode {
        message: e.to_string(),
    })?;
    if read != bytes.len() {
        return Err(CommError::TrailingBytes {
            count: bytes.len() - read,
        });
    }
    Ok(msg)
}

/// Encodes one message as a whole frame: length prefix and payload.
pub fn encode_frame<T: Serialize>(msg: &T) -> Result<Vec<u8>, CommError> {
    let payload = encode(msg)?;
    let len = u32::try_from(payload.len()).map_err(|_| CommError::FrameTooLarge {
        len: payload.len() as u64,
        limit: MAX_FRAME_BYTES,
    })?;
    let mut frame = Vec::with_capacity(FRAME_HEADER_BYTES + payload.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(&payload);
    Ok(frame)
}

/// Finds the first frame in `buf`: `Ok(Some((payload, consumed)))` when it is complete,
/// `Ok(None)` when more bytes are needed, and an error as soon as the length prefix
/// exceeds `limit` (capped at [`MAX_FRAME_BYTES`]) — before the payload arrives.
pub fn split_frame(buf: &[u8], limit: usize) -> Result<Option<(&[u8], usize)>, CommError> {
    let Some(header) = buf.first_chunk::<FRAME_HEADER_BYTES>() else {
        return Ok(None);
    };
    let len = check_len(u32::from_le_bytes(*header), limit)?;
    let end = FRAME_HEADER_BYTES + len;
    Ok(buf
        .get(FRAME_HEADER_BYTES..end)
        .map(|payload| (payload, end)))
}

/// Writes one frame and flushes `w`.
pub async fn write_frame<W, T>(w: &mut W, msg: &T) -> Result<(), CommError>
where
    W: AsyncWrite + Unpin,
    T: Serialize,
{
    let frame = encode_frame(msg)?;
    w.write_all(&frame).await?;
    w.flush().await?;
    Ok(())
}

/// Reads one frame and decodes its message.
///
/// Returns `Ok(None)` when the stream ends cleanly before a frame starts (the peer finished
/// its side). A stream that ends inside a frame is [`CommError::Truncated`]. The length
/// prefix is checked against `limit` (capped at [`MAX_FRAME_BYTES`]) before any memory is
/// reserved for the payload.
pub async fn read_frame<R, T>(r: &mut R, limit: usize) -> Result<Option<T>, CommError>
where
    R: AsyncRead + Unpin,
    T: DeserializeOwned,
{
    let mut header = [0u8; FRAME_HEADER_BYTES];
    let mut filled = 0;
    while filled < FRAME_HEADER_BYTES {
        match r.read(&mut header[filled..]).await? {
            0 if filled == 0 => return Ok(None),
            0 => {
                return Err(CommError::Truncated {
                    expected: FRAME_HEADER_BYTES,
                    got: filled,
                });
            }
            n => filled += n,
        }
    }
    let len = check_len(u32::from_le_bytes(header), limit)?;
    let mut payload = Vec::with_capacity(len.min(INITIAL_READ_RESERVE_BYTES));
    let got = r.take(len as u64).read_to_end(&mut payload).await?;
    if got < len {
        return Err(CommError::Truncated {
            expected: FRAME_HEADER_BYTES + len,
            got: FRAME_HEADER_BYTES + got,
        });
    }
    decode(&payload, limit).map(Some)
}

/// The payload length of a frame header, if it is within `limit` (capped at
/// [`MAX_FRAME_BYTES`]).
fn check_len(len: u32, limit: usize) -> Result<usize, CommError> {
    let limit = limit.min(MAX_FRAME_BYTES);
    match usize::try_from(len) {
        Ok(len) if len <= limit => Ok(len),
        _ => Err(CommError::FrameTooLarge {
            len: u64::from(len),
            limit,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_frame_waits_for_the_whole_payload() {
        let frame = encode_frame(&String::from("hello")).unwrap();
        for cut in 0..frame.len() {
            assert_eq!(split_frame(&frame[..cut], MAX_FRAME_BYTES).unwrap(), None);
        }
        let (payload, consumed) = split_frame(&frame, MAX_FRAME_BYTES).unwrap().unwrap();
        assert_eq!(consumed, frame.len());
        assert_eq!(decode::<String>(payload, MAX_FRAME_BYTES).unwrap(), "hello");
    }

    #[test]
    fn split_frame_refuses_a_long_prefix_before_the_payload() {
        let header = 1025u32.to_le_bytes();
        let err = split_frame(&header, 1024).unwrap_err();
        assert!(matches!(
            err,
            CommError::FrameTooLarge {
                len: 1025,
                limit: 1024
            }
        ));
    }

    #[test]
    fn limits_above_the_protocol_ceiling_are_capped() {
        let header = u32::try_from(MAX_FRAME_BYTES + 1).unwrap().to_le_bytes();
        assert!(split_frame(&header, usize::MAX).is_err());
    }

    #[test]
    fn a_forged_string_length_is_refused_without_reserving_it() {
        // varint 252 = u32 follows: a string claiming 4 GiB - 1 bytes, with 3 present.
        let bytes = [252, 0xff, 0xff, 0xff, 0xff, b'a', b'b', b'c'];
        let err = decode::<String>(&bytes, MAX_FRAME_BYTES).unwrap_err();
        assert!(err.to_string().contains("LimitExceeded"), "{err}");
        // 10 000 bytes claimed by an 8-byte input: over its tier's limit (8 KiB).
        let bytes = [251, 0x10, 0x27, b'a', b'b', b'c', b'd', b'e'];
        let err = decode::<String>(&bytes, MAX_FRAME_BYTES).unwrap_err();
        assert!(err.to_string().contains("LimitExceeded"), "{err}");
        // Within the tier: reserved, then found missing.
        let bytes = [251, 0x00, 0x10, b'a', b'b', b'c', b'd', b'e'];
        let err = decode::<String>(&bytes, MAX_FRAME_BYTES).unwrap_err();
        assert!(!err.to_string().contains("LimitExceeded"), "{err}");
    }

    /// The densest valid input (one-byte `u64`s, 8 claimed bytes each) decodes at every
    /// tier boundary.
    #[test]
    fn dense_messages_fit_their_tier() {
        for bound in [
            1usize << 10,
            4 << 10,
            16 << 10,
            64 << 10,
            256 << 10,
            1 << 20,
            4 << 20,
        ] {
            for len in bound - 8..=bound + 8 {
                let values = vec![1u64; len - 5];
                let bytes = encode(&values).unwrap();
                assert_eq!(decode::<Vec<u64>>(&bytes, MAX_FRAME_BYTES).unwrap(), values);
            }
        }
        let values = vec![1u64; MAX_FRAME_BYTES - 5];
        let bytes = encode(&values).unwrap();
        assert_eq!(bytes.len(), MAX_FRAME_BYTES);
        assert_eq!(
            decode::<Vec<u64>>(&bytes, MAX_FRAME_BYTES).unwrap().len(),
            values.len()
        );
    }

    #[test]
    fn long_strings_decode_in_every_tier() {
        for len in [0, 4000, 5000, 70_000, 2 << 20] {
            let text = "x".repeat(len);
            let bytes = encode(&text).unwrap();
            assert_eq!(decode::<String>(&bytes, MAX_FRAME_BYTES).unwrap(), text);
        }
    }
}
