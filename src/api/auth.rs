//! Optional bearer-token auth for the Evaluator service and the HTTP routes, and the admin
//! calls' own (Reload). Tokens are compared as SHA-256 digests in constant time: comparing the
//! tokens themselves takes time that depends on their lengths, which would tell a caller how
//! long a valid token is.

use crate::env::Secret;
use std::net::SocketAddr;
use subtle::ConstantTimeEq;
use tonic::{Code, Request, Status, service::Interceptor};

/// The bearer auth of evaluation calls: `evaluation` tokens, and `admin` ones too (an admin
/// call carries one `authorization`, and passes this before its own check); no auth when no
/// evaluation token is set.
pub(crate) fn evaluation_auth(evaluation: Vec<Secret>, admin: &[Secret]) -> BearerAuth {
    let mut tokens = evaluation;
    if !tokens.is_empty() {
        tokens.extend(admin.iter().cloned());
    }
    BearerAuth::new(tokens)
}

/// Who may make an admin call (Reload, which swaps what serves): a bearer of an admin token;
/// with none set, any caller of a loopback listener, and no one else. An evaluation token is
/// not enough: a trainer's key must not be able to swap the model.
#[derive(Clone)]
pub(crate) struct AdminAuth {
    tokens: BearerAuth,
    loopback: bool,
}

impl AdminAuth {
    /// The admin auth of the listener bound at `listener`.
    pub(crate) fn new(tokens: Vec<Secret>, listener: SocketAddr) -> Self {
        AdminAuth {
            tokens: BearerAuth::new(tokens),
            loopback: listener.ip().is_loopback(),
        }
    }

    /// Checks an admin call's `authorization` value; the error is its status code and why.
    pub(crate) fn check(&self, authorization: Option<&str>) -> Result<(), (Code, &'static str)> {
        if self.tokens.digests.is_empty() {
            return match self.loopback {
                true => Ok(()),
                false => Err((
                    Code::PermissionDenied,
                    "admin calls are refused on a listener that is not loopback unless \
                     server.admin_tokens_env names their tokens",
                )),
            };
        }
        self.tokens
            .check(authorization)
            .map_err(|why| (Code::Unauthenticated, why))
    }

    /// `check` for a gRPC call's metadata.
    pub(crate) fn check_grpc<T>(&self, request: &Request<T>) -> Result<(), Status> {
        self.check(authorization(request))
            .map_err(|(code, why)| Status::new(code, why))
    }
}

/// A gRPC call's `authorization` metadata, if it is text.
fn authorization<T>(request: &Request<T>) -> Option<&str> {
    request
        .metadata()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
}

/// Accepts a request whose `authorization` is `Bearer <token>` for a configured token; with no
/// tokens configured, accepts everything.
#[derive(Clone)]
pub(crate) struct BearerAuth {
    /// The accepted tokens' digests, computed once when the server starts; the tokens
    /// themselves are not kept.
    digests: std::sync::Arc<Vec<[u8; 32]>>,
}

impl BearerAuth {
    pub(crate) fn new(tokens: Vec<Secret>) -> Self {
        let digests = tokens.iter().map(|t| digest(t.0.as_bytes())).collect();
        BearerAuth {
            digests: std::sync::Arc::new(digests),
        }
    }

    fn accepts(&self, presented: &[u8]) -> bool {
        let presented = digest(presented);
        // Every digest is compared, so the time taken doesn't reveal which one matched.
        let matched = self
            .digests
            .iter()
            .fold(subtle::Choice::from(0), |ok, d| ok | d.ct_eq(&presented));
        matched.into()
    }
}

fn digest(token: &[u8]) -> [u8; 32] {
    let digest = ring::digest::digest(&ring::digest::SHA256, token);
    let mut out = [0u8; 32];
    out.copy_from_slice(digest.as_ref());
    out
}

impl BearerAuth {
    /// Checks an `authorization` value (gRPC metadata or HTTP header); the error says why.
    pub(crate) fn check(&self, authorization: Option<&str>) -> Result<(), &'static str> {
        if self.digests.is_empty() {
            return Ok(());
        }
        let presented = authorization
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or("missing `authorization: Bearer <token>`")?;
        match self.accepts(presented.as_bytes()) {
            true => Ok(()),
            false => Err("invalid bearer token"),
        }
    }
}

impl Interceptor for BearerAuth {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        self.check(authorization(&request))
            .map(|()| request)
            .map_err(|message| {
                crate::metrics::record_unauthenticated();
                Status::unauthenticated(message)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(auth: &mut BearerAuth, header: Option<&str>) -> Result<(), tonic::Code> {
        let mut r = Request::new(());
        if let Some(h) = header {
            r.metadata_mut().insert("authorization", h.parse().unwrap());
        }
        auth.call(r).map(|_| ()).map_err(|s| s.code())
    }

    #[test]
    fn checks_tokens() {
        let mut open = BearerAuth::new(vec![]);
        assert_eq!(call(&mut open, None), Ok(()));
        let mut auth = BearerAuth::new(vec![Secret("a".into()), Secret("bcd".into())]);
        assert_eq!(call(&mut auth, Some("Bearer bcd")), Ok(()));
        assert_eq!(call(&mut auth, Some("Bearer a")), Ok(()));
        assert_eq!(
            call(&mut auth, Some("Bearer bc")),
            Err(tonic::Code::Unauthenticated)
        );
        assert_eq!(
            call(&mut auth, Some("bcd")),
            Err(tonic::Code::Unauthenticated)
        );
        assert_eq!(call(&mut auth, None), Err(tonic::Code::Unauthenticated));
    }

    #[test]
    fn admin_calls_need_an_admin_token_or_a_loopback_listener_without_one() {
        let loopback: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        let anywhere: SocketAddr = "0.0.0.0:8080".parse().unwrap();
        let code = |a: &AdminAuth, h: Option<&str>| a.check(h).map_err(|(c, _)| c);
        let open = AdminAuth::new(vec![], loopback);
        assert_eq!(code(&open, None), Ok(()));
        let exposed = AdminAuth::new(vec![], anywhere);
        assert_eq!(code(&exposed, None), Err(Code::PermissionDenied));
        assert_eq!(
            code(&exposed, Some("Bearer anything")),
            Err(Code::PermissionDenied)
        );
        for at in [loopback, anywhere] {
            let admin = AdminAuth::new(vec![Secret("root".into())], at);
            assert_eq!(code(&admin, Some("Bearer root")), Ok(()));
            assert_eq!(
                code(&admin, Some("Bearer eval")),
                Err(Code::Unauthenticated)
            );
            assert_eq!(code(&admin, None), Err(Code::Unauthenticated));
        }
        // An admin token passes the evaluation check it comes through first; with no
        // evaluation token set, that check stays open rather than demanding the admin's.
        let admin = [Secret("root".into())];
        let mut both = evaluation_auth(vec![Secret("eval".into())], &admin);
        assert_eq!(call(&mut both, Some("Bearer root")), Ok(()));
        assert_eq!(call(&mut both, Some("Bearer eval")), Ok(()));
        let mut open = evaluation_auth(vec![], &admin);
        assert_eq!(call(&mut open, None), Ok(()));
    }

    #[test]
    fn only_the_very_token_is_accepted_whatever_the_lengths() {
        let token = "s3cret-token";
        let auth = BearerAuth::new(vec![Secret(token.into())]);
        assert!(auth.accepts(token.as_bytes()));
        let long = "s3cret-token".repeat(1000);
        for other in [
            "",
            "s",
            "s3cret-toke",
            "s3cret-token ",
            "s3cret-tokeN",
            long.as_str(),
        ] {
            assert!(!auth.accepts(other.as_bytes()), "{other:?}");
        }
        // What is kept is a fixed-size digest per token, whatever the token's length.
        let auth = BearerAuth::new(vec![Secret("x".into()), Secret(long.clone())]);
        assert_eq!(auth.digests.len(), 2);
        assert!(auth.accepts(b"x") && auth.accepts(long.as_bytes()));
    }
}
