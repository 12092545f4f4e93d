import type { Server } from 'node:http'
import type { Lfm2Model } from '../index.cjs'

/** What the server needs from a model: an `Lfm2Model`, or anything with the same methods. */
export type ServedModel = Pick<Lfm2Model, 'chat' | 'chatStream' | 'generate' | 'generateStream'>

export interface ServerOptions {
  model: ServedModel
  /** The id clients send as `model` and `GET /v1/models` lists (default 'mlx-lfm'); other ids get 404. */
  modelId?: string
  /** Larger request bodies get 413 (default 4 MiB). */
  maxBodyBytes?: number
  /** `max_tokens` when a request gives none (default 2048). */
  defaultMaxTokens?: number
  /** Called with one line per request and per server error. */
  log?: (line: string) => void
}

/**
 * An `http.Server` with the OpenAI API: `POST /v1/chat/completions`,
 * `POST /v1/completions` (both also with `stream: true`, as server-sent
 * events ending in `data: [DONE]`), `GET /v1/models`, `GET /v1/models/{id}`.
 * Errors are `{ error: { message, type, param, code } }` with 4xx/5xx codes.
 * A client that disconnects aborts its generation. Not yet listening.
 */
export declare function createServer(options: ServerOptions): Server

/** `createServer(options)` listening on `port` (default 8080; 0 picks one) and `host` (default 127.0.0.1). */
export declare function listen(
  options: ServerOptions,
  where?: { port?: number; host?: string },
): Promise<{ server: Server; port: number; url: string }>

/** An error answered with an OpenAI error body. */
export declare class ApiError extends Error {
  constructor(status: number, message: string, details?: { type?: string; param?: string | null; code?: string | null })
  status: number
  type: string
  param: string | null
  code: string | null
  body(): { error: { message: string; type: string; param: string | null; code: string | null } }
}
