import type { Server } from 'node:http'
import type { Lfm2Model } from '../index.cjs'

/** What the server needs from a model: an `Lfm2Model`, or anything with the same methods. */
export type ServedModel = Pick<Lfm2Model, 'chat' | 'chatStream' | 'generate' | 'generateStream'> & Partial<Pick<Lfm2Model, 'info'>>

export interface ServerOptions {
  model: ServedModel
  /** The id clients send as `model` and `GET /v1/models` lists (default 'mlx-lfm'); other ids get 404. */
  modelId?: string
  /** Larger request bodies get 413 (default 4 MiB). */
  maxBodyBytes?: number
  /** `max_tokens` when a request gives none (default 2048). */
  defaultMaxTokens?: number
  /**
   * A request whose prompt has more tokens is a 400 (`prompt_too_long`, naming
   * `messages` or `prompt`) before any compute. Default: the model's
   * `info().contextLength` when it has `info()`, else no limit.
   */
  maxPromptTokens?: number | null
  /** Every route but `GET /health` needs `Authorization: Bearer KEY` (at least 8 characters). */
  apiKey?: string | null
  /** Send CORS headers for this origin (none by default). */
  cors?: string | null
  /** POSTs beyond this many in flight get 503 with `Retry-After` (default 64). */
  maxQueued?: number
  /** A streaming client that takes no write for this long is disconnected and its generation cancelled (default 30000 ms). */
  stallMs?: number
  /** Timeouts against slow clients, in ms: the request headers (default 10000), the whole request (60000), an idle keep-alive connection (5000). */
  headersTimeout?: number
  requestTimeout?: number
  keepAliveTimeout?: number
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

/**
 * `createServer(options)` listening on `port` (default 8080; 0 picks one) and `host` (default 127.0.0.1;
 * any other address needs `apiKey`), with at most `maxConnections` connections (default 256). Timeouts
 * given here override those in `options`.
 */
export declare function listen(options: ServerOptions, where?: ListenOptions): Promise<{ server: Server; port: number; url: string }>

/** Where `listen()` listens. */
export interface ListenOptions {
  /** Default 8080; 0 picks a free port. */
  port?: number
  /** Default 127.0.0.1; anything but a loopback address needs `apiKey`. */
  host?: string
  /** Default 256. */
  maxConnections?: number
  /** Override `ServerOptions`' timeouts (ms). */
  headersTimeout?: number
  requestTimeout?: number
  keepAliveTimeout?: number
}

/** Whether `host` is a loopback address (`localhost`, `::1`, `127.x.y.z`): listening there needs no API key. */
export declare function isLoopback(host: string): boolean

/** An error answered with an OpenAI error body. */
export declare class ApiError extends Error {
  constructor(status: number, message: string, details?: { type?: string; param?: string | null; code?: string | null })
  status: number
  type: string
  param: string | null
  code: string | null
  body(): { error: { message: string; type: string; param: string | null; code: string | null } }
}
