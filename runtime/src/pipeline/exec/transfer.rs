//! What crosses a stage boundary: the receives posted ahead and taken when an action needs them,
//! the sends issued as route.rs orders them, each message's spec and the kind it travels in
//! (framed sparse payloads through sparse.rs).

use anyhow::bail;
use tch::{Kind, Tensor};

use super::{Executor, Progress};
use crate::pipeline::route::Transfer;
use crate::pipeline::sparse;
use crate::pipeline::wire::{Message, TensorSpec};
use crate::profiler_trace::Scope;

impl Executor {
    /// The spec of what `message` carries as this rank receives it.
    pub(super) fn recv_spec(&self, message: Message) -> anyhow::Result<&TensorSpec> {
        let spec = match message {
            Message::Activation(_) => self.input_spec.as_ref(),
            Message::Target(_) => self.target_spec.as_ref(),
            Message::Gradient(_) => self.output_spec.as_ref(),
            Message::Header => bail!("internal error: a shape header is received only at start"),
        };
        Ok(spec.expect("shapes are learned at start"))
    }

    /// The spec of what `message` carries as this rank sends it (the same spec its receiver has).
    pub(super) fn send_spec(&self, message: Message) -> anyhow::Result<&TensorSpec> {
        let spec = match message {
            Message::Activation(_) => self.output_spec.as_ref(),
            Message::Target(_) => self.target_spec.as_ref(),
            Message::Gradient(_) => self.input_spec.as_ref(),
            Message::Header => bail!("internal error: a shape header is sent only at start"),
        };
        Ok(spec.expect("shapes are learned at start"))
    }

    /// Whether `message` travels framed, a header then the payload it announces: activations and
    /// gradients under `--compress auto`, and both across a boundary where the model makes sparse
    /// COO tensors (their sizes vary with their entries).
    pub(super) fn framed(&self, message: Message, spec: &TensorSpec) -> bool {
        matches!(message, Message::Activation(_) | Message::Gradient(_)) && (self.sparse || spec.is_sparse())
    }

    /// Starts receiving `transfer` into a fresh buffer.
    pub(super) fn post_recv(&self, progress: &mut Progress, transfer: Transfer) -> anyhow::Result<()> {
        let spec = self.recv_spec(transfer.message)?;
        let mut tensor = if self.framed(transfer.message, spec) {
            // The header: the payload's form and size, then the payload itself (in `take`).
            sparse::header_buffer()
        } else {
            match self.wire_kind(transfer.message, spec.kind) {
                Some(kind) => Tensor::empty(spec.shape.as_slice(), (kind, self.device)),
                None => spec.empty(self.device),
            }
        };
        let work = self.channels().recv(transfer, &mut tensor)?;
        progress.posted.insert(transfer.message, (tensor, work, transfer));
        Ok(())
    }

    /// Receives the payload a framed message's `header` announces and rebuilds the tensor of the
    /// message's spec (in the kind it travels in): dense, or sparse COO as it was sent.
    pub(super) fn receive_payload(
        &self,
        transfer: Transfer,
        spec: &TensorSpec,
        header: &Tensor,
    ) -> anyhow::Result<Tensor> {
        let message = transfer.message;
        let kind = self.wire_kind(message, spec.kind).unwrap_or(spec.kind);
        let header = sparse::read_header(header)
            .map_err(|e| anyhow::anyhow!("{message:?} from rank {}: {e}", transfer.peer))?;
        let mut payload = Tensor::empty([header.bytes], (Kind::Uint8, self.device));
        self.channels().recv_payload(transfer, &mut payload)?.wait()?;
        sparse::decode(header, &payload, &spec.shape, kind)
            .map_err(|e| anyhow::anyhow!("{message:?} from rank {}: {e}", transfer.peer))
    }

    /// The posted receive of `message`, once it has arrived (a `receive` scope in a
    /// `--profiler-trace`: the wait for the peer is in it).
    pub(super) fn take(&self, progress: &mut Progress, message: Message) -> anyhow::Result<Tensor> {
        let _scope = Scope::enter(c"receive");
        let (tensor, work, transfer) = progress
            .posted
            .remove(&message)
            .expect("the program posts every receive before the action that takes it");
        work.wait()?;
        let spec = self.recv_spec(message)?;
        let tensor = match self.framed(message, spec) {
            true => self.receive_payload(transfer, spec, &tensor)?,
            false => tensor,
        };
        // NCCL's wait only orders the streams: settle here so the transfer is not timed as the
        // compute that follows.
        crate::cuda::synchronize(self.device)?;
        // A compressed activation goes back to the kind the stage computes in.
        Ok(match message {
            Message::Activation(_) if tensor.kind() != spec.kind => tensor.to_kind(spec.kind),
            _ => tensor,
        })
    }

    /// The kind `message` travels in when it is not `kind`: float16 for a float32 activation
    /// under `--compress-activations`.
    pub(super) fn wire_kind(&self, message: Message, kind: Kind) -> Option<Kind> {
        (self.compress_activations && matches!(message, Message::Activation(_)) && kind == Kind::Float)
            .then_some(Kind::Half)
    }

    /// Starts sending what the last action produced as `transfer`'s message.
    pub(super) fn send(&self, progress: &mut Progress, transfer: Transfer) -> anyhow::Result<()> {
        let tensor = progress
            .outbox
            .remove(&transfer.message)
            .expect("the action before a send produced its tensor");
        let tensor = match self.wire_kind(transfer.message, tensor.kind()) {
            Some(kind) => tensor.detach().to_kind(kind),
            None => tensor,
        };
        // A stage over several devices sends from its last one through the group's device.
        let tensor = match tensor.device() == self.device {
            true => tensor,
            false => tensor.detach().to_device(self.device),
        };
        let dense_bytes = (tensor.numel() * tensor.kind().elt_size_in_bytes()) as u64;
        progress.timing.wire.dense += dense_bytes;
        if self.framed(transfer.message, self.send_spec(transfer.message)?) {
            let encoded = sparse::encode(&tensor, self.sparse)
                .map_err(|e| anyhow::anyhow!("compressing {:?}: {e}", transfer.message))?;
            progress.timing.wire.sent += sparse::HEADER_LEN as u64 * 8 + encoded.payload.numel() as u64;
            progress
                .sends
                .push(self.channels().send(transfer, &encoded.header)?);
            progress
                .sends
                .push(self.channels().send_payload(transfer, &encoded.payload)?);
            return Ok(());
        }
        progress.timing.wire.sent += dense_bytes;
        // A sparse gradient for a dense input (a module whose backward makes one) goes as the
        // dense tensor its receiver expects.
        let tensor = match tensor.is_sparse() {
            true => tensor.to_dense(None::<Kind>, false),
            false => tensor.contiguous(),
        };
        let work = self.channels().send(transfer, &tensor)?;
        progress.sends.push(work);
        Ok(())
    }
}
