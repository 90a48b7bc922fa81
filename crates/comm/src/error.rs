//! (being written)

/// Errors of the control plane.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error("{message}")]
    Other { message: String },
}
