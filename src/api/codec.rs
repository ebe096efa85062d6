//! The protobuf codec of retrace.v1's service and client: prost's, except that a request which
//! does not decode is the caller's mistake (INVALID_ARGUMENT naming the message), not prost's
//! INTERNAL, which the status table keeps for our own bugs.

use super::pb;
use prost::Message;
use std::marker::PhantomData;
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic_prost::{ProstDecoder, ProstEncoder};

/// What prost's decode errors open with; the rest names the field and what was wrong with it.
const PROST_PREFIX: &str = "failed to decode Protobuf message: ";

/// Which end of a call reads a message, and so whose fault it is when it does not decode.
pub(super) trait Wire: Message + Default + Send + 'static {
    /// The message's full protobuf name, for error messages.
    const NAME: &'static str;
    /// The server reads it: a failure is the caller's input, INVALID_ARGUMENT. A response that
    /// does not decode stays INTERNAL on the client, as prost has it.
    const REQUEST: bool;
}

// Every message an RPC carries, each said once: an RPC added to the proto without a line here
// fails to compile instead of falling back to a guess.
macro_rules! wire {
    ($($name:ident => $request:literal),* $(,)?) => {
        $(impl Wire for pb::$name {
            const NAME: &'static str = concat!("retrace.v1.", stringify!($name));
            const REQUEST: bool = $request;
        })*
    };
}

wire! {
    EvaluateRequest => true,
    RankRequest => true,
    ListEvaluatorsRequest => true,
    ReloadRequest => true,
    EvaluateResponse => false,
    ReloadResponse => false,
    RankResponse => false,
    ListEvaluatorsResponse => false,
}

/// Named by `codec_path` in build.rs: the generated server and client use it for every RPC.
#[derive(Debug, Clone)]
pub(super) struct ProtoCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for ProtoCodec<T, U> {
    fn default() -> Self {
        ProtoCodec(PhantomData)
    }
}

impl<T, U> Codec for ProtoCodec<T, U>
where
    T: Message + Send + 'static,
    U: Wire,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ProtoDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::default()
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProtoDecoder(ProstDecoder::default())
    }
}

/// prost's decoder with the request side's errors made INVALID_ARGUMENT.
#[derive(Debug, Clone)]
pub(super) struct ProtoDecoder<U>(ProstDecoder<U>);

impl<U: Wire> Decoder for ProtoDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        match U::REQUEST {
            true => decode_request(buf).map(Some),
            false => self.0.decode(buf),
        }
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

/// Decodes a request, its failure put as the caller's error.
fn decode_request<U: Wire>(buf: &mut impl prost::bytes::Buf) -> Result<U, Status> {
    U::decode(buf).map_err(|e| undecodable(U::NAME, &e))
}

/// `request: could not be decoded as NAME: PATH: WHAT`, PATH being the field as our other errors
/// spell it (`trace.question`).
fn undecodable(name: &str, error: &prost::DecodeError) -> Status {
    let error = error.to_string();
    let detail = error.strip_prefix(PROST_PREFIX).unwrap_or(&error);
    Status::invalid_argument(super::status::capped(format!(
        "request: could not be decoded as {name}: {}",
        field_path(detail)
    )))
}

/// prost writes the way to the failing field innermost first, one `Message.field: ` each
/// (`Trace.question: EvaluateRequest.trace: invalid string value`); this turns it outermost
/// first into one path (`trace.question: invalid string value`). Text of another shape passes
/// through unchanged.
fn field_path(detail: &str) -> String {
    let mut fields = Vec::new();
    let mut rest = detail;
    while let Some((segment, after)) = rest.split_once(": ") {
        let field = segment.split_once('.').filter(|(message, field)| {
            message.starts_with(|c: char| c.is_ascii_uppercase())
                && [message, field].iter().all(|s| {
                    !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                })
        });
        let Some((_, field)) = field else { break };
        fields.push(field);
        rest = after;
    }
    fields.reverse();
    match fields.is_empty() {
        true => rest.to_string(),
        false => format!("{}: {rest}", fields.join(".")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    // tonic's DecodeBuf can't be made outside tonic; tests/it/unreadable.rs drives the whole codec
    // over a real call.
    fn decode<U: Wire>(mut bytes: &[u8]) -> Result<U, Status> {
        decode_request(&mut bytes)
    }

    #[test]
    fn a_request_that_does_not_decode_is_invalid_argument_naming_the_field() {
        // Field 3 (trace), length-delimited, holding field 1 (question) with bytes that are not
        // UTF-8.
        let bad = [0x1a, 0x04, 0x0a, 0x02, 0xff, 0xfe];
        let status = decode::<pb::EvaluateRequest>(&bad).unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert_eq!(
            status.message(),
            "request: could not be decoded as retrace.v1.EvaluateRequest: \
             trace.question: invalid string value: data is not UTF-8 encoded"
        );
        // Field 1 (id) says 127 bytes follow; one does.
        let status = decode::<pb::RankRequest>(&[0x0a, 0x7f, b'x']).unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert_eq!(
            status.message(),
            "request: could not be decoded as retrace.v1.RankRequest: id: buffer underflow"
        );
        // Wire type 7 does not exist: no field to name.
        let status = decode::<pb::EvaluateRequest>(&[0x0f]).unwrap_err();
        assert_eq!(
            status.message(),
            "request: could not be decoded as retrace.v1.EvaluateRequest: invalid wire type value: 7"
        );
    }

    #[test]
    fn good_bytes_decode() {
        let good = pb::EvaluateRequest {
            id: "r1".into(),
            ..Default::default()
        };
        let decoded = decode::<pb::EvaluateRequest>(&good.encode_to_vec()).unwrap();
        assert_eq!(decoded, good);
    }
}
