//! The candle model behind the batcher's `Scorer` seam, and how a config's in-process keys
//! load it (device, dtype, reuse): the one way the server and the feature extractor load one.

use super::batcher::{CacheStats, Row, ScoreError, Scorer};
use super::config::{DeviceSpec, Dtype, PrmConfig};
use super::format::Encoded;
use candle_core::{DType, Device};
use retrace_model::{Batch, HeadSpec, ModelError, PrmModel, Reuse, SharedBase, Span, TrainedSpec};
use std::path::Path;

impl Scorer for PrmModel {
    fn score(&self, batch: &[&Encoded]) -> Result<Vec<Row>, ScoreError> {
        let (rows, positions) = split(batch);
        let spans: Vec<&[Span]> = batch.iter().map(|e| e.marked_spans()).collect();
        let batch = Batch::new(&rows, &positions).with_spans(&spans);
        Ok(PrmModel::score(self, batch)?)
    }

    fn cache(&self) -> Option<CacheStats> {
        self.cache_stats()
    }

    fn cost(&self, encoded: &Encoded) -> usize {
        self.uncached_len(&encoded.ids)
    }
}

fn split<'a>(batch: &[&'a Encoded]) -> (Vec<&'a [u32]>, Vec<&'a [usize]>) {
    batch
        .iter()
        .map(|e| (e.ids.as_slice(), e.positions.as_slice()))
        .unzip()
}

/// The checkpoint at `folder` with `head`, on the device and in the dtype `cfg` puts it, with
/// its prefix cache and sharing.
pub(super) fn load_model(
    folder: &Path,
    head: HeadSpec,
    cfg: &PrmConfig,
) -> Result<PrmModel, ModelError> {
    let device = device(cfg.device())?;
    PrmModel::load(folder, head, &device, dtype(cfg.dtype()))?
        .with_reuse(reuse(cfg))
        .with_dequantized(dequantized(cfg))
}

/// The base at `path` without a head, as `load_model` would place it, for heads to share.
pub(super) fn load_base(
    path: &Path,
    cfg: &PrmConfig,
    served: Dtype,
) -> Result<SharedBase, ModelError> {
    SharedBase::load(path, &device(cfg.device())?, dtype(served))?
        .with_dequantized(dequantized(cfg))
}

/// The bytes of quantized matrices `cfg` keeps dequantized.
pub(super) fn dequantized(cfg: &PrmConfig) -> usize {
    cfg.candle
        .dequantized_mb
        .unwrap_or(0)
        .saturating_mul(1 << 20)
}

/// The trained head `spec` over `base`, with the prefix cache and sharing `cfg` asks for.
pub(super) fn load_on_base(
    base: &SharedBase,
    spec: &TrainedSpec,
    cfg: &PrmConfig,
) -> Result<PrmModel, ModelError> {
    Ok(PrmModel::on_base(base, spec)?.with_reuse(reuse(cfg)))
}

fn dtype(dtype: Dtype) -> DType {
    match dtype {
        Dtype::F32 => DType::F32,
        Dtype::Bf16 => DType::BF16,
        Dtype::F16 => DType::F16,
    }
}

fn reuse(cfg: &PrmConfig) -> Reuse {
    Reuse {
        cache_bytes: cfg.prefix_cache_mb() << 20,
        share: cfg.prefix_sharing(),
    }
}

/// The candle device a config names; CUDA needs a build with `--features cuda`.
pub(super) fn device(spec: DeviceSpec) -> Result<Device, ModelError> {
    let err = |reason: String| ModelError::Device {
        name: spec.to_string(),
        reason,
    };
    match spec {
        DeviceSpec::Cpu => Ok(Device::Cpu),
        DeviceSpec::Cuda(ordinal) if cfg!(feature = "cuda") => {
            Device::new_cuda(ordinal).map_err(|e| err(e.to_string()))
        }
        DeviceSpec::Cuda(_) => Err(err(
            "this build has no CUDA support; rebuild with `--features cuda`".to_string(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names() {
        assert!(matches!(device(DeviceSpec::Cpu), Ok(Device::Cpu)));
        if !cfg!(feature = "cuda") {
            let err = device(DeviceSpec::Cuda(0)).err().unwrap();
            assert!(err.to_string().contains("--features cuda"), "{err}");
            assert!(err.to_string().contains("cuda:0"), "{err}");
        }
    }
}
