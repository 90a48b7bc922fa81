//! Response ids and timestamps.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use rand::TryRngCore;
use rand::rngs::OsRng;

use super::error::ApiError;

pub(crate) fn unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// 128 random bits in hex, for response ids.
pub(crate) fn random_hex() -> Result<String, ApiError> {
    let mut bytes = [0u8; 16];
    OsRng
        .try_fill_bytes(&mut bytes)
        .map_err(|e| ApiError::internal(format!("cannot draw a random id: {e}")))?;
    let mut hex = String::with_capacity(32);
    for b in bytes {
        let _ = write!(hex, "{b:02x}");
    }
    Ok(hex)
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_are_32_hex_digits() {
        let id = super::random_hex().unwrap();
        assert_eq!(id.len(), 32);
        assert!(id.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_ne!(id, super::random_hex().unwrap());
    }
}
