//! What a forward pass gives back for the rows that want logits (the last token of each
//! chunk that asks), as the step runner asks for each ([`RowRequest`]): the row's logits,
//! for the host to sample, or a token sampled where the logits are, by the host's rule and
//! with the host's draw ([`RowOutput`]). A pass that cannot sample where it runs (the CPU
//! pass, a GPU group of more than one rank) gives every row its logits, and the runner
//! samples those as it always has. Pure bookkeeping, tested without a GPU.

use tessera_kernels::cpu::{RowDraw, ThresholdParams};

use crate::batch::wants_logits;
use crate::error::ModelError;
use crate::kv_cache::SeqChunk;

/// How one row that wants logits is to come back.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowRequest {
    /// Sample on the device with these settings and this draw; `None`: the host samples
    /// from the row's logits.
    pub draw: Option<RowDraw>,
    /// The row's logits are wanted as well (for logprobs).
    pub logits: bool,
}

impl RowRequest {
    /// The row's logits, for the host to sample.
    pub const LOGITS: RowRequest = RowRequest {
        draw: None,
        logits: true,
    };

    /// Whether the row's logits must come to the host.
    pub fn needs_logits(&self) -> bool {
        self.logits || self.draw.is_none()
    }
}

/// What a pass gives back for one row.
#[derive(Clone, Debug, PartialEq)]
pub enum RowOutput {
    /// Sampled where the logits are; the logits too where the request asked.
    Token {
        token: u32,
        logits: Option<Vec<f32>>,
    },
    /// The row's logits over the whole vocabulary: the host samples.
    Logits(Vec<f32>),
}

impl RowOutput {
    /// The row's logits, where it has them.
    pub fn into_logits(self) -> Option<Vec<f32>> {
        match self {
            RowOutput::Token { logits, .. } => logits,
            RowOutput::Logits(logits) => Some(logits),
        }
    }
}

/// Rows of `batch` that want logits: one per chunk that asks and has tokens.
pub(crate) fn wanted_rows(batch: &[SeqChunk<'_>]) -> usize {
    batch.iter().filter(|c| wants_logits(c)).count()
}

/// Refuses a pass given `requests` requests for `wanted` rows that want logits.
pub(crate) fn check_requests(requests: usize, wanted: usize) -> Result<(), ModelError> {
    if requests != wanted {
        return Err(ModelError::InvalidRequest {
            message: format!(
                "{requests} row requests for a batch of {wanted} rows that want logits"
            ),
        });
    }
    Ok(())
}

/// Whether any row asks to be sampled on the device.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // used by the device path
pub(crate) fn samples_on_device(requests: &[RowRequest]) -> bool {
    requests.iter().any(|r| r.draw.is_some())
}

/// The sampling kernel's draw for every row into `out`: a device row's own, greedy for the
/// others (the host samples them; their token is not read).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // used by the device path
pub(crate) fn device_draws(requests: &[RowRequest], out: &mut Vec<RowDraw>) {
    out.clear();
    out.extend(requests.iter().map(|r| {
        r.draw.unwrap_or(RowDraw {
            params: ThresholdParams::GREEDY,
            uniform: 0.0,
        })
    }));
}

/// The rows whose logits come to the host when the device samples, in row order.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // used by the device path
pub(crate) fn rows_to_download(requests: &[RowRequest]) -> impl Iterator<Item = usize> + '_ {
    requests
        .iter()
        .enumerate()
        .filter(|(_, r)| r.needs_logits())
        .map(|(i, _)| i)
}

/// Each row's output from the device's `tokens` (one per row) and the `downloaded` logits
/// of [`rows_to_download`]'s rows, in that order.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // used by the device path
pub(crate) fn assemble(
    requests: &[RowRequest],
    tokens: &[u32],
    downloaded: Vec<Vec<f32>>,
) -> Vec<RowOutput> {
    let mut downloaded = downloaded.into_iter();
    requests
        .iter()
        .zip(tokens)
        .map(|(r, &token)| {
            let logits = if r.needs_logits() {
                downloaded.next()
            } else {
                None
            };
            match (r.draw, logits) {
                (Some(_), logits) => RowOutput::Token { token, logits },
                (None, logits) => RowOutput::Logits(logits.unwrap_or_default()),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(logits: bool) -> RowRequest {
        RowRequest {
            draw: Some(RowDraw {
                params: ThresholdParams {
                    temperature: 0.7,
                    top_k: 40,
                    top_p: 0.9,
                    min_p: 0.0,
                },
                uniform: 0.25,
            }),
            logits,
        }
    }

    #[test]
    fn only_rows_sampled_on_the_host_or_asking_for_logprobs_download_logits() {
        let requests = [
            device(false),
            RowRequest::LOGITS,
            device(true),
            device(false),
        ];
        assert_eq!(rows_to_download(&requests).collect::<Vec<_>>(), [1, 2]);
        assert!(samples_on_device(&requests));
        assert!(!samples_on_device(&[RowRequest::LOGITS; 3]));
        let mut draws = Vec::new();
        device_draws(&requests, &mut draws);
        assert_eq!(draws[0], requests[0].draw.unwrap());
        assert!(draws[1].params.is_greedy());
        assert_eq!(draws.len(), 4);
    }

    #[test]
    fn outputs_pair_tokens_and_logits_with_their_rows() {
        let requests = [device(false), RowRequest::LOGITS, device(true)];
        let out = assemble(&requests, &[7, 99, 3], vec![vec![1.0, 2.0], vec![3.0, 4.0]]);
        assert_eq!(
            out,
            [
                RowOutput::Token {
                    token: 7,
                    logits: None
                },
                RowOutput::Logits(vec![1.0, 2.0]),
                RowOutput::Token {
                    token: 3,
                    logits: Some(vec![3.0, 4.0])
                },
            ]
        );
        assert_eq!(out[2].clone().into_logits(), Some(vec![3.0, 4.0]));
        assert_eq!(out[0].clone().into_logits(), None);
    }

    #[test]
    fn a_request_per_wanted_row() {
        assert!(check_requests(3, 3).is_ok());
        let err = check_requests(2, 3).unwrap_err().to_string();
        assert!(
            err.contains("2 row requests") && err.contains("3 rows"),
            "{err}"
        );
    }
}
