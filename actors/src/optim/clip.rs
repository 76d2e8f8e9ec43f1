//! Gradient clipping by the global L2 norm, as `torch.nn.utils.clip_grad_norm_` (Pascanu et al.,
//! "On the difficulty of training recurrent neural networks", ICML 2013), in two phases: each
//! shard's sum of squares ([`sum_of_squares`]), summed by the caller over every actor's shard
//! (dp, pp and ZeRO; the identity on one device), then the factor
//! `min(1, max_norm / (norm + 1e-6))` ([`clip_factor`]) by which every gradient is multiplied
//! before the update (the optimizer applies it inside its loop, so the gradients are not copied).

/// Σx² of a shard of gradients, accumulated in f64.
pub fn sum_of_squares(values: &[f32]) -> f64 {
    values.iter().map(|&x| (x as f64) * (x as f64)).sum()
}

/// PyTorch's clipping factor for the squared global norm `total_squares` and bound `max_norm`:
/// `min(1, max_norm / (‖g‖ + 1e-6))`.
pub fn clip_factor(total_squares: f64, max_norm: f32) -> f32 {
    let norm = total_squares.max(0.0).sqrt();
    (max_norm as f64 / (norm + 1e-6)).min(1.0) as f32
}
