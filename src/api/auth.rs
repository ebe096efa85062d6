//! Optional bearer-token auth for the Evaluator service, compared in constant time.

use crate::env::Secret;
use subtle::ConstantTimeEq;
use tonic::{Request, Status, service::Interceptor};

/// Accepts a request whose `authorization` is `Bearer <token>` for a configured token; with no
/// tokens configured, accepts everything.
#[derive(Clone)]
pub struct BearerAuth {
    tokens: std::sync::Arc<Vec<Secret>>,
}

impl BearerAuth {
    pub fn new(tokens: Vec<Secret>) -> Self {
        BearerAuth {
            tokens: std::sync::Arc::new(tokens),
        }
    }

    fn accepts(&self, presented: &[u8]) -> bool {
        // Check every token so the time taken doesn't reveal which one nearly matched.
        self.tokens.iter().fold(false, |ok, t| {
            ok | bool::from(t.0.as_bytes().ct_eq(presented))
        })
    }
}

impl BearerAuth {
    /// Checks an `authorization` value (gRPC metadata or HTTP header); the error says why.
    pub fn check(&self, authorization: Option<&str>) -> Result<(), &'static str> {
        if self.tokens.is_empty() {
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
        let presented = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok());
        self.check(presented).map(|()| request).map_err(|message| {
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
}
